"""A fleet on real processes: emulated lanes, a sidecar in front of each, SGLang's own router in front.

Every part is a separate process on loopback, started the way an SRE would start it: ``sglang-sidecar
emulate`` per lane, ``sglang-sidecar serve`` per lane, and ``python -m sglang_router.launch_router``
(the ``sglang-router`` wheel) over the sidecars (or straight over the emulators, for the baseline).
The router re-serialises request bodies, so the clients here send real ``input_ids``: the size a
sidecar judges is the exact count of what the engine would receive.

What is measured is what a person would look at: each request's status and reason as the client saw
it, the router's circuit-breaker transitions (from its own log: "Circuit breaker state transition:
closed -> open" is a lane ejected), the emulators' crashes (seen as ``/health`` refusing, :class:`CrashWatch`), and the attempts each sidecar answered (its decision counters).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from sidecar.policy.schema import LoadedPolicy
from sidecar_emulator.demo import scale_policy

ROUTER_ANSWERS: dict[str, Any] = {
    # The README's block for routers before issue 26, now the default (413 for a request no lane can
    # ever run: not retried; smg counts it a success for its breaker, sglang-router 0.3.2 a failure).
    "unfit_lane": {"status": 413, "retry_after": False, "should_retry": False},
}
# What the sidecar answered before issue 26 (unfit and busy both 503): both routers retry a 503 and
# count it against the lane's breaker, so a burst of unrunnable requests ejects healthy lanes.
ANSWERS_BEFORE_26: dict[str, Any] = {
    "unfit_lane": {"status": 503, "retry_after": False, "should_retry": False},
    "transient": {"status": 503, "retry_after": True, "should_retry": True},
}
# The flags sglang-router 0.3.2 needs with the sidecar (docs/routing.md): it counts every non-2xx
# answer, 413 and 429 included, against its breaker, so the breaker is off and a lane whose engine is
# really gone is ejected by the health check on the sidecar's /readyz instead. smg needs none.
RECOMMENDED_ROUTER_FLAGS = [
    "--disable-circuit-breaker",
    "--health-check-endpoint",
    "/readyz",
    "--health-check-interval-secs",
    "5",
    "--health-failure-threshold",
    "2",
]


@dataclass(frozen=True)
class RouterKind:
    """One of SGLang's routers as a wheel installs it (pinned in the test extra: what each does with
    an answer was measured on that version, docs/routing.md)."""

    name: str
    module: str  # ``python -m <module>`` starts it
    policies: tuple[str, ...]  # its --policy choices that route a plain request (no PD, no header)


# PyPI's last ``sglang-router`` (SGLang's in-tree router before it became the model gateway).
SGLANG_ROUTER = RouterKind(
    "sglang-router 0.3.2",
    "sglang_router.launch_router",
    ("round_robin", "random", "cache_aware", "power_of_two"),
)
# The SGLang model gateway's own package: polls /v1/loads, overload veto on by default.
SMG = RouterKind(
    "smg 1.13.0",
    "smg.launch_router",
    (
        "round_robin",
        "random",
        "cache_aware",
        "power_of_two",
        "least_load",
        "consistent_hashing",
        "prefix_hash",
    ),
)
ROUTER_KINDS = {"sglang-router": SGLANG_ROUTER, "smg": SMG}
BREAKER_OPEN = re.compile(r"Circuit breaker state transition: closed -> open")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    proc: asyncio.subprocess.Process
    log: Path
    url: str
    metrics_url: str | None = None  # the router's own Prometheus listener

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()


async def spawn(name: str, args: list[str], workdir: Path, url: str) -> Proc:
    log = workdir / f"{name}.log"
    out = log.open("wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = await asyncio.create_subprocess_exec(*args, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env)
    out.close()
    return Proc(name, proc, log, url)


async def wait_ready(p: Proc, path: str, deadline_s: float = 60.0) -> None:
    """Poll ``path`` until it answers 200; the deadline only turns a hang into a clear failure."""
    end = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as s:
        while True:
            if p.proc.returncode is not None:
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{p.text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with s.get(p.url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > end:
                raise RuntimeError(f"{p.name} not ready at {path} after {deadline_s} s:\n{p.text()[-2000:]}")
            await asyncio.sleep(0.1)


def write_policy(loaded: LoadedPolicy, speed: float, answers: dict[str, Any] | None, path: Path) -> Path:
    """The lane's policy with its clocks scaled to the emulator's speed (and an ``answers:`` block)."""
    data = scale_policy(loaded, speed).policy.model_dump(mode="json", exclude_defaults=True)
    if answers:
        data["answers"] = answers
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class Lane:
    engine: Proc
    sidecar: Proc | None = None

    @property
    def url(self) -> str:
        return self.sidecar.url if self.sidecar is not None else self.engine.url


@dataclass
class Fleet:
    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    async def engine(self, name: str, profile: str, speed: float, restart_s: float) -> Proc:
        port = free_port()
        gpu = self.workdir / f"{name}.gpu.json"
        args = [
            sys.executable,
            "-m",
            "sidecar",
            "emulate",
            "--profile",
            profile,
            "--listen",
            f"127.0.0.1:{port}",
        ]
        args += ["--speed", str(speed), "--gpu-file", str(gpu), "--restart-s", str(restart_s)]
        p = await spawn(name, args, self.workdir, f"http://127.0.0.1:{port}")
        self.procs.append(p)
        return p

    async def sidecar(self, name: str, engine: Proc, policy: Path) -> Proc:
        port = free_port()
        gpu = self.workdir / f"{engine.name}.gpu.json"
        args = [sys.executable, "-m", "sidecar", "serve", "--upstream", engine.url, "--policy", str(policy)]
        args += ["--listen", f"127.0.0.1:{port}", "--gpu-source", f"file:{gpu}", "--log-level", "warning"]
        # Its admin listener too: the default (127.0.0.1:8002) would collide between lanes.
        args += ["--admin-listen", f"127.0.0.1:{free_port()}"]
        args += ["--decision-log", str(self.workdir / f"{name}.decisions.jsonl")]
        p = await spawn(name, args, self.workdir, f"http://127.0.0.1:{port}")
        self.procs.append(p)
        return p

    async def router(
        self,
        name: str,
        workers: list[str],
        flags: list[str],
        *,
        kind: RouterKind | None = None,
        policy: str = "round_robin",
    ) -> Proc:
        kind = kind or SGLANG_ROUTER
        port = free_port()
        args = [sys.executable, "-m", kind.module, "--worker-urls", *workers]
        args += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
        # Its own metrics listener: a fixed default port would collide between routers.
        mport = free_port()
        args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport), *flags]
        p = await spawn(name, args, self.workdir, f"http://127.0.0.1:{port}")
        p.metrics_url = f"http://127.0.0.1:{mport}/metrics"
        self.procs.append(p)
        return p

    async def stop(self, p: Proc) -> None:
        await p.stop()
        if p in self.procs:
            self.procs.remove(p)

    async def close(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.procs))
        self.procs.clear()


@contextlib.asynccontextmanager
async def fleet(workdir: Path) -> AsyncIterator[Fleet]:
    f = Fleet(workdir)
    try:
        yield f
    finally:
        await f.close()


async def lanes(
    f: Fleet,
    n: int,
    profile: str,
    loaded: LoadedPolicy,
    speed: float,
    *,
    sidecars: dict[str, dict[str, Any] | None] | None = None,
    restart_s: float = 774.0,
) -> tuple[list[Proc], dict[str, list[Proc]]]:
    """``n`` emulators and, per entry of ``sidecars`` (a label -> answers block), a sidecar in front of
    each: several sets of sidecars may share the lanes (their answers differ, the engines do not)."""
    engines = [await f.engine(f"engine{i}", profile, speed, restart_s) for i in range(n)]
    await asyncio.gather(*(wait_ready(e, "/health") for e in engines))
    sets: dict[str, list[Proc]] = {}
    for label, answers in (sidecars or {}).items():
        policy = write_policy(loaded, speed, answers, f.workdir / f"policy-{label}.yaml")
        sets[label] = [await f.sidecar(f"sidecar-{label}{i}", e, policy) for i, e in enumerate(engines)]
    await asyncio.gather(*(wait_ready(s, "/readyz") for group in sets.values() for s in group))
    return engines, sets


JSON_HEADERS = {"content-type": "application/json"}


@dataclass
class Answer:
    kind: str  # "unfit" | "small"
    status: int
    code: str | None
    seconds: float


async def send(s: aiohttp.ClientSession, url: str, tokens: int, kind: str, max_new: int = 8) -> Answer:
    body = {"input_ids": [11] * tokens, "sampling_params": {"max_new_tokens": max_new}, "stream": False}
    # Compact JSON, 3 bytes a token: 300K tokens stay under smg's 1 MiB retry cut (the hard case).
    data = json.dumps(body, separators=(",", ":"))
    t = time.monotonic()
    try:
        async with s.post(url + "/generate", data=data, headers=JSON_HEADERS) as r:
            data = await r.read()
            code = None
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                err = json.loads(data).get("error")
                code = err.get("code") if isinstance(err, dict) else None
            return Answer(kind, r.status, None if code is None else str(code), time.monotonic() - t)
    except (aiohttp.ClientError, TimeoutError) as e:
        return Answer(kind, 0, type(e).__name__, time.monotonic() - t)


async def burst_then_small(
    router_url: str, *, unfit_tokens: int, n_unfit: int = 16, concurrency: int = 8, n_small: int = 10
) -> list[Answer]:
    """The finding's experiment: ``n_unfit`` requests no lane can run, ``concurrency`` at a time, then
    ``n_small`` small requests one after another (each after the burst has been answered)."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> Answer:
            async with gate:
                return await send(s, router_url, unfit_tokens, "unfit")

        out = list(await asyncio.gather(*(one() for _ in range(n_unfit))))
        for _ in range(n_small):
            out.append(await send(s, router_url, 100, "small"))
    return out


async def router_retries(router: Proc) -> int:
    """Retries the router made (``smg_worker_retries_total``, summed), read from its own /metrics."""
    assert router.metrics_url is not None
    async with aiohttp.ClientSession() as s, s.get(router.metrics_url) as r:
        text = await r.text()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("smg_worker_retries_total")
        )
    )


def breaker_opens(router: Proc) -> int:
    return len(BREAKER_OPEN.findall(router.text()))


class CrashWatch:
    """Counts each engine's crashes as a client would see them: ``/health`` that answered, then a
    connection refused or dropped (the emulator's crash drops every connection and stops listening).
    A slow answer is not a crash (two cores shared by every process here)."""

    def __init__(self, engines: list[Proc], every_s: float = 0.1) -> None:
        self.engines = engines
        self.every_s = every_s
        self.crashes: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> CrashWatch:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        up = {e.name: True for e in self.engines}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s:
            while True:
                for e in self.engines:
                    try:
                        async with s.get(e.url + "/health"):
                            ok = True  # it answered: alive (a busy engine may answer slowly or 503)
                    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError):
                        ok = False  # refused or dropped: the crash's signature
                    except (aiohttp.ClientError, TimeoutError):
                        ok = up[e.name]  # slow on a loaded machine is not a crash
                    if up[e.name] and not ok:
                        self.crashes[e.name] += 1
                    up[e.name] = ok
                await asyncio.sleep(self.every_s)


def sidecar_answers(sidecar: Proc) -> Counter[str]:
    """The sidecar's final decisions by reason (from its decision log): how many attempts it answered."""
    path = sidecar.log.with_name(sidecar.name + ".decisions.jsonl")
    out: Counter[str] = Counter()
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("decision") != "hold":
                    out[rec.get("reason") or "admit"] += 1
    return out


def summarize(answers: list[Answer]) -> dict[str, Any]:
    small = [a for a in answers if a.kind == "small"]
    unfit = [a for a in answers if a.kind == "unfit"]
    return {
        "small_served": sum(1 for a in small if a.status == 200),
        "small_sent": len(small),
        "small_statuses": dict(Counter(str(a.status) for a in small)),
        "unfit_statuses": dict(Counter(str(a.status) for a in unfit)),
        "unfit_codes": dict(Counter(str(a.code) for a in unfit)),
        "unfit_p50_s": round(sorted(a.seconds for a in unfit)[len(unfit) // 2], 2) if unfit else None,
    }
