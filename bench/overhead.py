"""What the sidecar costs on the data path, against nginx and against no proxy at all, in one run.

Everything runs on 127.0.0.1 as separate processes: the constant-cost upstream (``bench/upstream.py``),
Debian's nginx 1.22 in front of it (one worker, buffering off, upstream keep-alive), the stack's
floor (``bench/floor_proxy.py``: uvicorn + aiohttp relaying and nothing else; saturation only) and
the sidecar (``sglang-sidecar serve`` with a loop-lag probe, ``bench/probed_sidecar.py``), which polls the
upstream's real-sized /metrics and a GPU source in the background the whole time. With 12 or more
cores each server is pinned to its own cores (the upstream 4, nginx 2, the sidecar 2, wrk 4, the
Python client 2); with fewer they share, and only the per-request CPU figures and the ratios mean
much. nginx and wrk are Debian's packages, extracted into ``.tools/`` when not installed.

Shapes (``load`` / ``kind`` in the rows):

- saturation: wrk, 64 connections, as fast as the path answers, in ``--rounds`` interleaved rounds
  (each server has its turn in every round; a row keeps its cheapest round, ``spread`` = dearest /
  cheapest): ``small`` (a small ``POST /generate``, through the gate on the sidecar),
  ``small-passthrough`` (``GET /v1/models``), ``sse`` (a gated ``POST /generate`` streaming 100 events
  of ~200 bytes), ``sse-long`` (the same streaming 400 events,
  for 4x the phase; nginx, the sidecar and its own floor only: the slope between the two is the relay's
  CPU per event, the intercept each SSE request's own). Latency figures are wrk's, whole responses.
- paced: a Python client holds 64 streams that each receive 20 events/s, like decoding models; added
  time to first byte and added inter-event gap, p50/p99, over direct. ``sse``: the 64 one-second
  streams start together, so each second 64 gated requests arrive in one burst; ``sse-staggered``:
  stream i starts i/64 s in, so they arrive spread out, as independent clients' would. The sidecar's own
  floor (``floor-uvicorn``) runs this phase too, its loop probed like the sidecar's.
- large: gated requests carrying 64K, 128K and 500K-token prompts as text (~4 bytes a token) and as
  ``input_ids``, one at a time; added time to first byte over direct, and the proxy's peak RSS (VmHWM,
  reset before each kind) against its RSS before.
- idle: the sidecar doing nothing but polling its signals: its CPU with this benchmark's lag probe
  stopped (the probe's 1 ms tick costs ~20 ms/s of its own), then the loop-lag figures of a second
  window with the probe ticking.

    make bench-overhead [ARGS="--quick"]      # or: .venv/bin/python bench/overhead.py --help

Prints a table, the targets of issue #12 and issue #27's figures, each also beside the same figure for
the sidecar's own floor (where the floor alone misses a goal, the goal is beyond this stack), and writes
``bench/results/overhead.json`` (``--json``). The loop probe (``bench/lag_probe.py``) reports the
wall-clock lag and the loop thread's own CPU per tick (``busy_*``: the stall's work, apart from the
scheduler's share, which dominates on a shared machine). Under the tables, ``bench/host_speed.py``'s
line: a fixed Python loop timed at the start, every round and the end; where its spread passes 1.2x the
host changed speed during the run (a lent host's neighbours), and the run is not one to judge by.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import debtools  # bench/ is not a package: imported from beside this file
import host_speed

ROOT = Path(__file__).resolve().parents[1]
# The in-process decision microbenchmark imports the sidecar: from this checkout, installed or not
# (the lent GPU machine runs a copy of the tree with no editable install).
sys.path.insert(1, str(ROOT))
CONCURRENCY = 64
SSE_EVENTS = 100
# The same stream four times as long (nginx, the sidecar and its own floor only), for four times as
# long: the CPU per event of the relay alone, as the slope between the two, apart from each request's
# own work (the intercept). As long as the phase scales with the stream, the streams cut off when wrk
# stops (CPU spent, no request counted) weigh the same in both shapes.
SSE_LONG_EVENTS = 400
PACED_STREAMS = 64
PACED_EVENTS_PER_S = 20
LARGE_TOKENS = {"64k": 65_536, "128k": 131_072, "500k": 500_000}

POLICY = """
name: overhead-bench
description: every gate open; the benchmark measures the path, not the decisions
lane: {context_len: 1048576, chunked_prefill_size: 8192}
cost: {activation_bytes_per_chunk_token: 1KiB, context_bytes_per_token: 1}
engine_queue: {max_requests: 1000000}
pending_prefill: {max_tokens: 1000000000}
engine: {poll_interval_s: 0.5, max_age_s: 30, on_stale: admit}
gpu: {poll_interval_s: 0.1, max_age_s: 30, on_stale: admit, required: false}
hold: {max_held: 1000, max_wait_s: 60}
"""

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
{user}
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fcgi;
  uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream engine {{ server 127.0.0.1:{upstream}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    client_max_body_size 0;
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""

WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {"requests":%d,"duration_us":%d,"errors":%d,"status_errors":%d,'
    .. '"p50_us":%d,"p99_us":%d}\\n', summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status, latency:percentile(50), latency:percentile(99)))
end
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and every descendant alive now (all threads included)."""
    total = 0.0
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for task in Path(f"/proc/{pid}/task").iterdir():
            children = (task / "children").read_text().split()
            total += sum(cpu_seconds(int(c)) for c in children)
    return total


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    vals = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            vals[key] = int(rest.split()[0]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def reset_peak(pid: int) -> None:
    """Reset VmHWM to the current RSS (Linux 4.0+: ``echo 5 > clear_refs``)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass
class Cores:
    """Which cores each process gets; ``None``: no pinning (too few cores to keep them apart)."""

    upstream: list[int] | None = None
    nginx: list[int] | None = None
    sidecar: list[int] | None = None
    wrk: list[int] | None = None
    client: list[int] | None = None
    upstream_workers: int = 1
    wrk_threads: int = 2

    @classmethod
    def plan(cls) -> Cores:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 12:
            return cls(wrk_threads=min(2, len(cpus)))
        return cls(
            upstream=cpus[0:4],
            nginx=cpus[4:6],
            sidecar=cpus[6:8],
            wrk=cpus[8:12],
            client=cpus[12:14] if len(cpus) >= 14 else cpus[8:12],
            upstream_workers=4,
            wrk_threads=4,
        )


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def _pinned(cores: list[int] | None) -> Any:
    if cores is None:
        return None
    return lambda: os.sched_setaffinity(0, cores)


async def wait_up(url: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up within {deadline_s:g} s")


def bench_env(args: argparse.Namespace) -> dict[str, str]:
    """The benchmark processes' environment: this checkout importable, the /metrics page's size."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "BENCH_METRICS_REPEAT": str(args.metrics_repeat)}


def start_upstream(up: Server, cores: Cores, env: dict[str, str], log: Any) -> None:
    """``bench/upstream.py`` under uvicorn at ``up.url``, on the upstream's cores and workers."""
    up.proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bench.upstream:app", "--port", up.url.rsplit(":", 1)[1],
         "--workers", str(cores.upstream_workers), "--log-level", "warning", "--no-access-log"],
        cwd=ROOT, env=env, stdout=log, stderr=log, preexec_fn=_pinned(cores.upstream),
    )  # fmt: skip


def start_nginx(ng: Server, up: Server, args: argparse.Namespace, cores: Cores, tmp: Path, log: Any) -> None:
    """Debian's nginx at ``ng.url`` in front of ``up`` (``NGINX_CONF``), on nginx's cores."""
    nginx, nginx_env = debtools.ensure("nginx", args.tools_dir)
    conf = tmp / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            tmp=tmp,
            upstream=up.url.rsplit(":", 1)[1],
            port=ng.url.rsplit(":", 1)[1],
            user="user root root;" if os.geteuid() == 0 else "",
        )
    )
    ng.proc = subprocess.Popen(
        [nginx, "-p", str(tmp), "-e", str(tmp / "nginx-error.log"), "-c", str(conf)],
        env={**os.environ, **nginx_env}, stdout=log, stderr=log, preexec_fn=_pinned(cores.nginx),
    )  # fmt: skip
    ng.extra["version"] = subprocess.run(
        [nginx, "-v"], env={**os.environ, **nginx_env}, capture_output=True, text=True
    ).stderr.strip()


@contextlib.contextmanager
def servers(args: argparse.Namespace, cores: Cores, tmp: Path) -> Iterator[dict[str, Server]]:
    env = bench_env(args)
    up = Server("direct", f"http://127.0.0.1:{free_port()}")
    ng = Server("nginx", f"http://127.0.0.1:{free_port()}")
    sc = Server("sidecar", f"http://127.0.0.1:{free_port()}")
    fl = Server("floor", f"http://127.0.0.1:{free_port()}")
    procs: list[subprocess.Popen[bytes]] = []
    log = (tmp / "servers.log").open("wb")
    try:
        start_upstream(up, cores, env, log)
        procs.append(up.proc)
        start_nginx(ng, up, args, cores, tmp, log)
        procs.append(ng.proc)
        policy = tmp / "policy.yaml"
        policy.write_text(POLICY)
        gpu = args.gpu_source
        if gpu is None:
            gpu_file = tmp / "gpu.json"
            gpu_file.write_text(json.dumps({"free_bytes": 100 << 30, "total_bytes": 141 << 30}))
            gpu = f"file:{gpu_file}"
        sc.extra["gpu_source"] = gpu
        sc.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "probed_sidecar.py"), "serve", "--upstream", up.url,
             "--listen", sc.url.removeprefix("http://"), "--policy", str(policy), "--gpu-source", gpu,
             *([] if args.decision_log == "off" else ["--decision-log", args.decision_log]),
             "--log-level", "warning", "--admin-listen", "127.0.0.1:0"],
            cwd=ROOT, env=env, stdout=log, stderr=log, preexec_fn=_pinned(cores.sidecar),
        )  # fmt: skip
        procs.append(sc.proc)
        # The stack's own floors, on the sidecar's cores (they are loaded one at a time): ``floor`` is
        # uvicorn + aiohttp (the figure every earlier run printed); ``floor-<server>`` relays through the
        # sidecar's own lean client under each ASGI server that is installed (issue #27, step 5).
        floors = {"floor": ("uvicorn", "aiohttp")} | {f"floor-{srv}": (srv, "lean") for srv in args.floors}
        extra: dict[str, Server] = {}
        for name, (server, client) in floors.items():
            f = fl if name == "floor" else Server(name, f"http://127.0.0.1:{free_port()}")
            # The sidecar's own floor runs the paced phase too: with the sidecar's lag probe (ticking in
            # that phase only), so the paced loop stall has the floor's figure beside it.
            probe = ["--lag-probe"] if name == OWN_FLOOR else []
            f.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "floor_proxy.py"), "--upstream", up.url,
                 "--port", f.url.rsplit(":", 1)[1], "--server", server, "--client", client, *probe],
                cwd=ROOT, env=env, stdout=log, stderr=log, preexec_fn=_pinned(cores.sidecar),
            )  # fmt: skip
            f.extra.update(server=server, client=client)
            procs.append(f.proc)
            if name != "floor":
                extra[name] = f
        urls = [up.url + "/health", ng.url + "/health", sc.url + "/healthz", fl.url + "/health"]
        for url in urls + [f.url + "/health" for f in extra.values()]:
            asyncio.run(wait_up(url))
        time.sleep(1.0)  # a few polls, so the gate has signals
        yield {"direct": up, "nginx": ng, "sidecar": sc, "floor": fl} | extra
    except BaseException:
        log.flush()
        sys.stderr.write((tmp / "servers.log").read_text()[-4000:])
        raise
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


# --------------------------------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------------------------------

SMALL_BODY = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}})
SSE_BODY = json.dumps({"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": SSE_EVENTS}})
SSE_LONG_BODY = json.dumps(
    {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": SSE_LONG_EVENTS}}
)
# The saturation phase's shapes: path, method, body, events per request (``--shapes`` picks some).
SHAPES: dict[str, tuple[str, str, str | None, int]] = {
    "small": ("/generate", "POST", SMALL_BODY, 1),
    "small-passthrough": ("/v1/models", "GET", None, 0),
    "sse": (f"/generate?events={SSE_EVENTS}", "POST", SSE_BODY, SSE_EVENTS),
    "sse-long": (f"/generate?events={SSE_LONG_EVENTS}", "POST", SSE_LONG_BODY, SSE_LONG_EVENTS),
}


def lua_script(tmp: Path, name: str, method: str, body: str | None) -> Path:
    lines = [f'wrk.method = "{method}"']
    if body is not None:
        lines += [f"wrk.body = {json.dumps(body)}", 'wrk.headers["Content-Type"] = "application/json"']
    path = tmp / f"{name}.lua"
    path.write_text("\n".join(lines) + "\n" + WRK_DONE)
    return path


def wrk(args: argparse.Namespace, cores: Cores, url: str, script: Path, seconds: float) -> dict[str, Any]:
    binary, env = debtools.ensure("wrk", args.tools_dir)
    cmd = [binary, "-t", str(cores.wrk_threads), "-c", str(CONCURRENCY), "-d", f"{max(1, round(seconds))}s"]
    cmd += ["--timeout", "10s", "-s", str(script), url]
    out = subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, preexec_fn=_pinned(cores.wrk), check=True
    )  # fmt: skip
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary:\n{out.stdout}\n{out.stderr}")
    return json.loads(line.removeprefix("WRKJSON "))


def saturation(
    args: argparse.Namespace,
    cores: Cores,
    srv: dict[str, Server],
    tmp: Path,
    speed: host_speed.Readings | None = None,
) -> list[dict]:
    """Every shape through every server, ``args.rounds`` times, the servers taking turns in each round.

    A shared host's neighbours come and go within seconds: one short window per server can land one
    server's figure in a noisy second and the next server's in a quiet one, and a difference of two
    such figures (gate work = gated - pass-through) then measures the neighbours. Interleaved rounds
    put every server in every stretch of the run; each row keeps the round that cost the least CPU per
    request (noise only adds CPU: cache and core sharing), with the spread over the rounds beside it
    (``cpu_spread``: dearest / cheapest) and every round's figure (``cpu_s_per_1000_requests_rounds``).
    The rounds share one process per server: they do not sample the spread between processes, which
    was ~20 % for the sidecar's gated request on a quiet lent host (a process's CPU per request at
    saturation is 1 / its throughput, and that moves with how requests batch per loop turn;
    bench/results/2026-12-07-issue27-lent-quiet.md). Compare trees over several runs. ``speed``: the
    host's speed is read at the start of each round (``bench/host_speed.py``).
    """
    shapes = {k: v for k, v in SHAPES.items() if not args.shapes or k in args.shapes}
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        if speed is not None:
            speed.take(f"round {rnd + 1}")
        for kind, (path, method, body, events) in shapes.items():
            script = lua_script(tmp, kind, method, body)
            for name, s in srv.items():
                if kind == "sse-long" and name not in ("nginx", "sidecar", OWN_FLOOR):
                    continue
                if args.servers and name not in args.servers:
                    continue
                if rnd == 0:  # warm: connections, caches, the sidecar's first-use paths
                    wrk(args, cores, s.url + path, script, 1)
                cpu0 = cpu_seconds(s.pid)
                r = wrk(args, cores, s.url + path, script, args.seconds * max(1, events // SSE_EVENTS))
                cpu = cpu_seconds(s.pid) - cpu0
                dur = r["duration_us"] / 1e6
                n = r["requests"]
                samples.setdefault((name, kind), []).append(
                    dict(
                        ttfb_p50_ms=r["p50_us"] / 1000, ttfb_p99_ms=r["p99_us"] / 1000,
                        requests_per_s=n / dur,
                        sse_events_per_s=n * events / dur if events > 1 else None,
                        cpu_s_per_1000_requests=1000 * cpu / max(1, n),
                        cpu_s_per_1000_events=1000 * cpu / max(1, n * events) if events > 1 else None,
                        errors=r["errors"] + r["status_errors"],
                    )
                )  # fmt: skip
    return [_saturation_row(name, kind, got) for (name, kind), got in samples.items()]


def _saturation_row(name: str, kind: str, got: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's shape over the rounds: the cheapest round's figures, the spread and every round's CPU."""
    cpus = [g["cpu_s_per_1000_requests"] for g in got]
    best = got[cpus.index(min(cpus))]
    return row(
        name, "saturation", kind, CONCURRENCY, **best,
        rounds=len(got),
        cpu_spread=max(cpus) / min(cpus) if min(cpus) > 0 else None,
        cpu_s_per_1000_requests_rounds=cpus,
        errors_all_rounds=sum(g["errors"] for g in got),
    )  # fmt: skip


async def _paced(url: str, seconds: float, staggered: bool = False) -> dict[str, Any]:
    """64 one-second streams back to back. ``staggered``: stream i starts i/64 s in, so requests
    arrive spread over each second like independent clients', instead of all 64 in one burst."""
    interval_ms = 1000 / PACED_EVENTS_PER_S
    events = PACED_EVENTS_PER_S  # one-second streams, back to back
    target = f"{url}/generate?events={events}&interval_ms={interval_ms:g}"
    ttfb: list[float] = []
    gaps: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=PACED_STREAMS, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def stream(i: int) -> None:
            nonlocal errors
            if staggered:
                await asyncio.sleep(i / PACED_STREAMS)
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    async with s.post(
                        target, data=SSE_BODY, headers={"Content-Type": "application/json"}
                    ) as r:
                        last = None
                        async for _chunk in r.content.iter_any():
                            now = time.perf_counter()
                            if last is None:
                                ttfb.append(now - t0)
                            else:
                                gaps.append(now - last)
                            last = now
                        if r.status != 200:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1

        await asyncio.gather(*(stream(i) for i in range(PACED_STREAMS)))
    return {"ttfb": ttfb, "gaps": gaps, "errors": errors}


def paced(args: argparse.Namespace, cores: Cores, srv: dict[str, Server]) -> list[dict]:
    if cores.client is not None:
        os.sched_setaffinity(0, cores.client)
    rows = []
    for kind, staggered in (("sse", False), ("sse-staggered", True)):
        results = {}
        for name, s in srv.items():
            cpu0 = cpu_seconds(s.pid)
            results[name] = asyncio.run(_paced(s.url, args.seconds, staggered))
            results[name]["cpu"] = cpu_seconds(s.pid) - cpu0
        rows += _paced_rows(kind, results, args.seconds)
    return rows


def _paced_rows(kind: str, results: dict[str, dict[str, Any]], seconds: float) -> list[dict]:
    base = results["direct"]
    rows = []
    for name, r in results.items():
        n_events = len(r["gaps"]) + len(r["ttfb"])
        rows.append(
            row(
                name, "paced", kind, PACED_STREAMS,
                ttfb_p50_ms=1000 * pct(r["ttfb"], 0.5), ttfb_p99_ms=1000 * pct(r["ttfb"], 0.99),
                added_ttfb_p50_ms=1000 * (pct(r["ttfb"], 0.5) - pct(base["ttfb"], 0.5)),
                added_ttfb_p99_ms=1000 * (pct(r["ttfb"], 0.99) - pct(base["ttfb"], 0.99)),
                inter_event_p99_ms=1000 * pct(r["gaps"], 0.99),
                added_inter_event_p99_ms=1000 * (pct(r["gaps"], 0.99) - pct(base["gaps"], 0.99)),
                requests_per_s=len(r["ttfb"]) / seconds,
                sse_events_per_s=n_events / seconds,
                cpu_s_per_1000_events=1000 * r["cpu"] / max(1, n_events),
                cpu_s_per_1000_requests=1000 * r["cpu"] / max(1, len(r["ttfb"])),
                errors=r["errors"],
            )
        )  # fmt: skip
    return rows


def large_body(kind: str) -> bytes:
    form, size = kind.split("-")
    tokens = LARGE_TOKENS[size]
    if form == "ids":
        ids = [(i * 7919) % 150_000 for i in range(tokens)]
        return json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}).encode()
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "engineers",
    ]
    text = " ".join(words[i % len(words)] for i in range(tokens))  # ~1 token a word, ~4.5 bytes each
    return json.dumps({"text": text, "sampling_params": {"max_new_tokens": 1}}).encode()


async def _large(url: str, body: bytes, reps: int) -> tuple[list[float], int]:
    ttfb = []
    errors = 0
    async with aiohttp.ClientSession() as s:
        for _ in range(reps):
            t0 = time.perf_counter()
            async with s.post(
                url + "/generate", data=body, headers={"Content-Type": "application/json"}
            ) as r:
                ttfb.append(time.perf_counter() - t0)
                await r.read()
                errors += r.status != 200
    return ttfb, errors


def large(args: argparse.Namespace, cores: Cores, srv: dict[str, Server]) -> list[dict]:
    rows = []
    for form in ("text", "ids"):
        for size in LARGE_TOKENS:
            kind = f"{form}-{size}"
            body = large_body(kind)
            results = {}
            for name, s in srv.items():
                asyncio.run(_large(s.url, body, 1))  # warm: connection, first-use allocations
                before, _ = rss(s.pid)
                reset_peak(s.pid)
                cpu0 = cpu_seconds(s.pid)
                ttfb, errors = asyncio.run(_large(s.url, body, args.large_reps))
                cpu = cpu_seconds(s.pid) - cpu0
                _, peak = rss(s.pid)
                results[name] = (ttfb, errors, cpu, before, peak)
            base = results["direct"][0]
            for name, (ttfb, errors, cpu, before, peak) in results.items():
                rows.append(
                    row(
                        name, "large", kind, 1,
                        ttfb_p50_ms=1000 * pct(ttfb, 0.5), ttfb_p99_ms=1000 * pct(ttfb, 0.99),
                        added_ttfb_p50_ms=1000 * (pct(ttfb, 0.5) - pct(base, 0.5)),
                        added_ttfb_p99_ms=1000 * (pct(ttfb, 0.99) - pct(base, 0.99)),
                        requests_per_s=len(ttfb) / sum(ttfb),
                        cpu_s_per_1000_requests=1000 * cpu / len(ttfb),
                        peak_rss_bytes=peak, rss_before_bytes=before, body_bytes=len(body),
                        errors=errors,
                    )
                )  # fmt: skip
    return rows


def lag(srv: dict[str, Server], name: str = "sidecar", probe: str = "") -> dict[str, Any]:
    """The loop-lag figures of ``name`` since the last read (and reset); ``probe``: ``on``/``off`` to
    start or stop a probe that ticks only when asked (the floor's)."""
    query = f"?probe={probe}" if probe else ""

    async def get() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(srv[name].url + "/__bench/lag" + query) as r:
            return await r.json()

    return asyncio.run(get())


def paced_with_floor_lag(args: argparse.Namespace, cores: Cores, srv: dict[str, Server],
                         floor_lags: dict[str, dict]) -> list[dict]:  # fmt: skip
    """The paced phase, the sidecar's own floor's loop probed through it (``floor_lags["paced"]``)."""
    probed = OWN_FLOOR in srv
    if probed:
        lag(srv, OWN_FLOOR, "on")
    proxies = {k: v for k, v in srv.items() if not k.startswith("floor")}
    rows = paced(args, cores, proxies | own_floor(srv))
    if probed:
        floor_lags["paced"] = lag(srv, OWN_FLOOR, "off")
    return rows


ROW_FIELDS = (
    "path", "load", "kind", "concurrency", "ttfb_p50_ms", "ttfb_p99_ms", "added_ttfb_p50_ms",
    "added_ttfb_p99_ms", "inter_event_p99_ms", "added_inter_event_p99_ms", "requests_per_s",
    "sse_events_per_s", "cpu_s_per_1000_events", "cpu_s_per_1000_requests", "peak_rss_bytes",
    "rss_before_bytes", "body_bytes", "errors", "loop_lag_max_ms", "machine", "rounds", "cpu_spread",
    "cpu_s_per_1000_requests_rounds", "errors_all_rounds",
)  # fmt: skip
MACHINE = ""


def row(path: str, load: str, kind: str, concurrency: int, **values: Any) -> dict[str, Any]:
    r: dict[str, Any] = dict.fromkeys(ROW_FIELDS)
    r.update(path=path, load=load, kind=kind, concurrency=concurrency, machine=MACHINE, **values)
    return r


def find(rows: list[dict], path: str, load: str, kind: str) -> dict | None:
    return next((r for r in rows if (r["path"], r["load"], r["kind"]) == (path, load, kind)), None)


def targets(rows: list[dict], lags: dict[str, dict]) -> list[dict[str, Any]]:
    """Issue #12's targets, each with the measured value and whether it is met."""

    def ratio(load: str, kind: str, metric: str) -> float | None:
        sc, ng = find(rows, "sidecar", load, kind), find(rows, "nginx", load, kind)
        if not sc or not ng or not ng[metric] or sc[metric] is None:
            return None
        return sc[metric] / ng[metric]

    out = []

    def target(
        name: str, value: float | None, limit: float, unit: str, higher_is_better: bool = False
    ) -> None:
        met = None if value is None else (value >= limit if higher_is_better else value <= limit)
        out.append({"target": name, "value": value, "limit": limit, "unit": unit, "met": met})

    target(
        "CPU per gated small request vs nginx",
        ratio("saturation", "small", "cpu_s_per_1000_requests"),
        5,
        "x",
    )
    target(
        "CPU per pass-through request vs nginx",
        ratio("saturation", "small-passthrough", "cpu_s_per_1000_requests"), 3, "x",
    )  # fmt: skip
    target("SSE CPU per event vs nginx", ratio("saturation", "sse", "cpu_s_per_1000_events"), 1.2, "x")
    sse = find(rows, "sidecar", "saturation", "sse")
    target("SSE events/s through one sidecar", sse and sse["sse_events_per_s"], 20_000, "ev/s", True)
    p = find(rows, "sidecar", "paced", "sse") or {}
    target("paced: added TTFB p50", p.get("added_ttfb_p50_ms"), 1, "ms")
    target("paced: added TTFB p99", p.get("added_ttfb_p99_ms"), 5, "ms")
    target("paced: added inter-event p99", p.get("added_inter_event_p99_ms"), 2, "ms")
    q = find(rows, "sidecar", "paced", "sse-staggered") or {}
    target("paced, staggered starts: added TTFB p50", q.get("added_ttfb_p50_ms"), 1, "ms")
    target("paced, staggered starts: added TTFB p99", q.get("added_ttfb_p99_ms"), 5, "ms")
    for kind in ("text-500k", "ids-500k"):
        big = find(rows, "sidecar", "large", kind) or {}
        target(f"large {kind}: added TTFB p50", big.get("added_ttfb_p50_ms"), 50, "ms")
        if big.get("peak_rss_bytes"):
            grown = (big["peak_rss_bytes"] - big["rss_before_bytes"]) / big["body_bytes"]
            target(f"large {kind}: RSS per in-flight request / body size", grown, 2, "x")
    target("loop stall while signals poll (idle)", lags.get("idle", {}).get("max_ms"), 5, "ms")
    target("loop stall while signals poll (paced)", lags.get("paced", {}).get("max_ms"), 5, "ms")
    return out


def floor_ratios(rows: list[dict]) -> list[dict[str, Any]]:
    """Where the sidecar's cost goes: the pure ASGI + aiohttp relay (``bench/floor_proxy.py``) against
    nginx is the stack's floor; the sidecar against that relay is the sidecar's own work."""
    out = []
    for kind, metric in (
        ("small", "cpu_s_per_1000_requests"),
        ("small-passthrough", "cpu_s_per_1000_requests"),
        ("sse", "cpu_s_per_1000_events"),
    ):
        ng, fl, sc = (find(rows, p, "saturation", kind) for p in ("nginx", "floor", "sidecar"))
        if ng and fl and sc and ng[metric] and fl[metric]:
            out.append({
                "kind": kind, "metric": metric, "floor_vs_nginx": fl[metric] / ng[metric],
                "sidecar_vs_floor": sc[metric] / fl[metric], "sidecar_vs_nginx": sc[metric] / ng[metric],
            })  # fmt: skip
    return out


def decision_microbench(n: int = 20_000) -> dict[str, float]:
    """The pure core in-process: p50/p99 of one ``decide`` (a 4K-token request, open gate), in µs."""
    from sidecar.core import demand as demands
    from sidecar.core.decide import Situation, decide
    from sidecar.core.ledger import LedgerTotals
    from sidecar.core.snapshot import DeviceMemory, EngineSignals, GpuSignals, Snapshot, SourceHealth
    from sidecar.policy.in_force import rules_of
    from sidecar.policy.schema import load_policy_text

    rules = rules_of(load_policy_text(POLICY, "overhead-bench.yaml").policy)
    now = time.monotonic()
    engine = EngineSignals(
        observed_at=now, running_requests=0, queue_requests=0, kv_available_tokens=10_000_000,
        max_total_tokens=10_000_000, full_token_usage=0.0,
    )  # fmt: skip
    gpu = GpuSignals(observed_at=now, source="bench", devices=(DeviceMemory("gpu0", 100 << 30, 141 << 30),))
    ok = SourceHealth(last_ok_at=now)
    snap = Snapshot(engine=engine, gpu=gpu, engine_health=ok, gpu_health=ok)
    situation = Situation(rules, snap, LedgerTotals(), now)
    demand = demands.build(rules, 4096, arrived_at=now)
    assert decide(demand, situation).admitted
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        decide(demand, situation)
        samples.append(time.perf_counter_ns() - t0)
    return {"p50_us": pct(samples, 0.5) / 1000, "p99_us": pct(samples, 0.99) / 1000, "samples": n}


def fmt(v: Any, scale: float = 1.0, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v * scale:,.{digits}f}"


def _errors(r: dict[str, Any]) -> int:
    """A row's errors: over every saturation round (a row keeps one round's figures, not its errors)."""
    every = r.get("errors_all_rounds")
    return every if every is not None else r["errors"] or 0


def print_table(rows: list[dict], tg: list[dict], lags: dict[str, dict], micro: dict | None) -> None:
    print(f"\nproxy overhead on {MACHINE}; {host_speed.interpreter()}")
    head = (
        f"{'load':11}{'kind':18}{'path':8}{'req/s':>10}{'ev/s':>10}{'cpu ms/1k req':>14}{'spread':>7}"
        f"{'cpu ms/1k ev':>13}"
    )
    head += (
        f"{'ttfb p50':>9}{'p99':>9}{'+ttfb p50':>10}{'+p99':>8}{'+gap p99':>9}{'peak RSS MB':>12}{'err':>5}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['load']:11}{r['kind']:18}{r['path']:8}{fmt(r['requests_per_s'], 1, 0):>10}"
            f"{fmt(r['sse_events_per_s'], 1, 0):>10}{fmt(r['cpu_s_per_1000_requests'], 1000):>14}"
            f"{fmt(r.get('cpu_spread')):>7}{fmt(r['cpu_s_per_1000_events'], 1000):>13}"
            f"{fmt(r['ttfb_p50_ms']):>9}{fmt(r['ttfb_p99_ms']):>9}"
            f"{fmt(r['added_ttfb_p50_ms']):>10}{fmt(r['added_ttfb_p99_ms']):>8}"
            f"{fmt(r['added_inter_event_p99_ms']):>9}{fmt(r['peak_rss_bytes'], 1e-6, 0):>12}{_errors(r):>5}"
        )
    print("\nsidecar event-loop lag (1 ms probe), per phase: " + ", ".join(
        f"{k} max {fmt(v.get('max_ms'))} ms ({v.get('over_5ms', 0)} > 5 ms; longest gc pause "
        f"{fmt(v.get('gc_max_ms'))} ms, {v.get('gc_full_collections', 0)} full)"
        for k, v in lags.items()
    ))  # fmt: skip
    if micro:
        print(f"decision in-process: p50 {micro['p50_us']:.1f} µs, p99 {micro['p99_us']:.1f} µs")
    print("\ntargets (issue #12)")
    for t in tg:
        state = {True: "met", False: "NOT MET", None: "n/a"}[t["met"]]
        print(f"  {t['target']:52} {fmt(t['value']):>10} {t['unit']:5} limit {t['limit']:g}  {state}")


def print_busy(lags: dict[str, dict], floor_lags: dict[str, dict]) -> None:
    """The loop thread's own CPU within one probe tick, per phase (``bench/lag_probe.py``): the work a
    stall is made of, apart from time the thread was off the CPU (the wall-clock lag above includes the
    scheduler's, most of it on a shared machine), the sidecar's and its own floor's."""
    for who, by_phase in (("sidecar", lags), (OWN_FLOOR, floor_lags)):
        cells = [f"{k} max {fmt(v.get('busy_max_ms'))} ms, p99 {fmt(v.get('busy_p99_ms'))} ms "
                 f"({v.get('busy_over_5ms', 0)} > 5 ms)" for k, v in by_phase.items() if v.get("samples")]  # fmt: skip
        if cells:
            print(f"{who} loop thread's CPU in one tick: " + ", ".join(cells))
        top = by_phase.get("paced", {}).get("busy_top", [])
        if top:
            print(f"  {who}'s heaviest paced ticks, ms of CPU [collections in them: generation, ms]: " + ", ".join(
                f"{t['cpu_ms']:.1f}" + (f" {t['gc']}" if t["gc"] else "") for t in top))  # fmt: skip
    paced = floor_lags.get("paced", {})
    if paced.get("samples"):
        print(f"{OWN_FLOOR} event-loop lag, paced: max {fmt(paced.get('max_ms'))} ms ({paced.get('over_5ms', 0)} > 5 ms;"
              f" longest gc pause {fmt(paced.get('gc_max_ms'))} ms)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    global MACHINE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="short phases (about four minutes in all with three rounds, under two with --rounds 1)",
    )
    ap.add_argument(
        "--seconds", type=float, help="length of each saturation and paced phase (default 8, quick 2)"
    )
    ap.add_argument(
        "--rounds", type=int, default=3,
        help="saturation rounds, the servers taking turns in each; a row keeps its cheapest (default 3)",
    )  # fmt: skip
    ap.add_argument(
        "--decision-log", default=os.devnull,
        help="the sidecar's --decision-log (default /dev/null: the writer runs, the disk does not); "
        "'off' runs it without one",
    )  # fmt: skip
    ap.add_argument(
        "--large-reps", type=int, help="requests per large-body kind and path (default 10, quick 3)"
    )
    ap.add_argument("--metrics-repeat", type=int, default=1, help="repeat the upstream's /metrics series k x")
    ap.add_argument("--gpu-source", help="the sidecar's GPU source (default: a file:, nvml on a GPU host)")
    ap.add_argument("--machine", help="label for the rows (default: cores and CPU model)")
    ap.add_argument("--tools-dir", type=Path, default=debtools.TOOLS, help="where nginx/wrk are extracted")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "overhead.json")
    ap.add_argument(
        "--only", choices=("saturation", "paced", "large"), action="append", help="run only these"
    )
    ap.add_argument(
        "--floors", default=",".join(installed_servers()),
        help="ASGI servers measured as floors with the sidecar's client (default: those installed)",
    )  # fmt: skip
    ap.add_argument("--no-hold-queue", action="store_true", help="skip bench/hold_queue.py's figures")
    ap.add_argument(
        "--servers", help="saturation through these only (comma-separated, e.g. sidecar,nginx; default all)"
    )
    ap.add_argument(
        "--shapes",
        help=f"saturation of these shapes only (comma-separated: {', '.join(SHAPES)}; default all)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be 1 or more, got {args.rounds}")
    args.floors = [f for f in args.floors.split(",") if f]
    args.servers = [x for x in (args.servers or "").split(",") if x]
    names = ["direct", "nginx", "sidecar", "floor"] + [f"floor-{f}" for f in args.floors]
    unknown = [x for x in args.servers if x not in names]
    if unknown:  # a misspelt name would measure nothing and print an empty table
        ap.error(f"--servers: no server named {', '.join(unknown)} (there are: {', '.join(names)})")
    args.shapes = [x for x in (args.shapes or "").split(",") if x]
    unknown = [x for x in args.shapes if x not in SHAPES]
    if unknown:
        ap.error(f"--shapes: no shape named {', '.join(unknown)} (there are: {', '.join(SHAPES)})")
    args.seconds = args.seconds or (2.0 if args.quick else 8.0)
    args.large_reps = args.large_reps or (3 if args.quick else 10)
    MACHINE = args.machine or f"{os.cpu_count()} cores, {cpu_model()}"
    phases = args.only or ["saturation", "paced", "large"]
    cores = Cores.plan()
    started = time.monotonic()
    speed = host_speed.Readings()
    speed.take("start")
    rows: list[dict] = []
    lags: dict[str, dict] = {}
    floor_lags: dict[str, dict] = {}  # the own floor's loop probe, paced phase only
    with tempfile.TemporaryDirectory(prefix="overhead-") as t, servers(args, cores, Path(t)) as srv:
        # What each process burns with no traffic: the sidecar's pollers alone, this benchmark's own 1 ms
        # lag probe stopped (it costs ~20 ms/s by itself, which is the bench's, not the sidecar's) ...
        lag(srv, "sidecar", "off")
        idle0 = {name: cpu_seconds(s.pid) for name, s in srv.items()}
        time.sleep(args.seconds)
        idle = {name: 1000 * (cpu_seconds(s.pid) - idle0[name]) / args.seconds for name, s in srv.items()}
        # ... then the loop's stalls while the signals poll, with the probe ticking again.
        lag(srv, "sidecar", "on")
        probed0 = cpu_seconds(srv["sidecar"].pid)
        time.sleep(args.seconds)
        lags["idle"] = lag(srv)
        idle_probed = 1000 * (cpu_seconds(srv["sidecar"].pid) - probed0) / args.seconds
        proxies = {k: v for k, v in srv.items() if not k.startswith("floor")}  # the floors: saturation only
        for phase in phases:
            rows += {"saturation": lambda: saturation(args, cores, srv, Path(t), speed),
                     "paced": lambda: paced_with_floor_lag(args, cores, srv, floor_lags),
                     "large": lambda: large(args, cores, proxies)}[phase]()  # fmt: skip
            lags[phase] = lag(srv)
        versions = {"nginx": srv["nginx"].extra["version"], "gpu_source": srv["sidecar"].extra["gpu_source"]}
    speed.take("end")
    for r in rows:
        if r["path"] == "sidecar":
            r["loop_lag_max_ms"] = lags.get(r["load"], {}).get("max_ms")
        elif r["path"] == OWN_FLOOR:
            r["loop_lag_max_ms"] = floor_lags.get(r["load"], {}).get("max_ms")
    micro = decision_microbench()
    tg = targets(rows, lags)
    print_table(rows, tg, lags, micro)
    print_busy(lags, floor_lags)
    print("idle CPU, ms per s (pollers; the bench's lag probe off): "
          + ", ".join(f"{k} {v:.1f}" for k, v in idle.items())
          + f"; the sidecar with the 1 ms lag probe ticking {idle_probed:.1f}")  # fmt: skip
    floor = floor_ratios(rows)
    print("\nthe stack's floor (bench/floor_proxy.py: uvicorn + aiohttp relaying, nothing else), CPU ratios")
    for f in floor:
        print(
            f"  {f['kind']:18} floor/nginx {f['floor_vs_nginx']:6.2f} x   sidecar/floor {f['sidecar_vs_floor']:5.2f} x"
            f"   sidecar/nginx {f['sidecar_vs_nginx']:6.2f} x"
        )
    servers_table(rows)
    held = [] if args.no_hold_queue else hold_queue_figures(args)
    goals = issue27(rows, lags, idle, micro, held, floor_lags)
    print_issue27(goals, speed.warning())
    print("\n" + speed.line())
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": MACHINE,
        "cores": os.cpu_count(),
        "pinning": vars(cores),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"},
        "versions": {
            **versions,
            "python": platform.python_version(),
            "interpreter": host_speed.interpreter(),
        },
        "wall_s": round(time.monotonic() - started, 1),
        "host_speed": speed.as_json(),
        "rows": rows,
        "loop_lag": lags,
        "floor_loop_lag": floor_lags,
        "idle_cpu_ms_per_s": idle,
        "idle_cpu_ms_per_s_sidecar_probe_ticking": idle_probed,
        "decision_in_process": micro,
        "targets": tg,
        "floor": floor,
        "issue27": goals,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.json} ({doc['wall_s']:g} s)")
    return 0


def servers_table(rows: list[dict]) -> None:
    """The floors side by side (issue #27 step 5): each ASGI server relaying through the sidecar's own
    client (``floor-<server>``) and uvicorn + aiohttp (``floor``), as CPU per request or event and
    saturation throughput, each also / nginx."""
    print("\nASGI servers as floors (bench/floor_proxy.py; CPU us per request or event, req/s; x nginx)")
    print(
        f"  {'path':16}{'small us':>10}{'x':>7}{'req/s':>9}{'pass us':>10}{'x':>7}{'sse us/ev':>11}{'x':>7}"
    )
    ng = {k: find(rows, "nginx", "saturation", k) for k in ("small", "small-passthrough", "sse")}
    for path in sorted({r["path"] for r in rows if r["path"].startswith("floor")} | {"sidecar"}):
        cells = []
        for kind, metric in (("small", "cpu_s_per_1000_requests"), ("small-passthrough", "cpu_s_per_1000_requests"),
                             ("sse", "cpu_s_per_1000_events")):  # fmt: skip
            r, n = find(rows, path, "saturation", kind), ng[kind]
            v = r[metric] * 1000 if r and r[metric] is not None else None
            x = v / (n[metric] * 1000) if v is not None and n and n[metric] else None
            cells.append((v, x, r["requests_per_s"] if r else None))
        (a, ax, rps), (b, bx, _), (c, cx, _) = cells
        print(f"  {path:16}{fmt(a, 1, 0):>10}{fmt(ax, 1, 1):>7}{fmt(rps, 1, 0):>9}{fmt(b, 1, 0):>10}{fmt(bx, 1, 1):>7}"
              f"{fmt(c, 1, 1):>11}{fmt(cx, 1, 1):>7}")  # fmt: skip


OWN_FLOOR = "floor-uvicorn"


def own_floor(srv: dict[str, Server]) -> dict[str, Server]:
    """The sidecar's own floor (its server, its client), where it runs: paced too, so that a burst's
    added time to first byte has the figure the stack itself reaches beside the sidecar's."""
    return {k: v for k, v in srv.items() if k == OWN_FLOOR}


def installed_servers() -> list[str]:
    """The ASGI servers ``bench/floor_proxy.py`` can run here (uvicorn always: the sidecar's own)."""
    import importlib.util

    return ["uvicorn"] + [m for m in ("granian", "hypercorn") if importlib.util.find_spec(m) is not None]


# Issue #27's table: what each figure was when it was filed (lent 16-core H100 host, --quick) and its goal.
# A "keep" goal is met while the figure is no worse than it was (ratios to nginx, or the ms as filed).
ISSUE27_WAS = {
    "gated": "383 us, 18.9x nginx, 2.04x floor",
    "pass": "78 us, 4.05x nginx",
    "gate": "~305 us",
    "burst": "18.6 / 19.0 ms",
    "staggered": "0.92 / 0.88 ms",
    "sse": "3.73x nginx",
    "stall": "10.4 ms",
    "idle": "55 ms/s",
    "saturation": "247 ms (nginx 1.7)",
}


def _us(r: dict | None) -> float | None:
    return None if r is None or r["cpu_s_per_1000_requests"] is None else 1000 * r["cpu_s_per_1000_requests"]


def issue27(
    rows: list[dict], lags: dict[str, dict], idle: dict[str, float], micro: dict | None, held: list[dict],
    floor_lags: dict[str, dict] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every figure of issue #27's table, measured in this run, with its goal and whether it is met,
    and beside it the same figure for the stack's floor (``floor_figures``)."""
    out = _issue27_figures(rows, lags, idle, micro, held)
    at_floor = floor_figures(rows, idle, floor_lags or {})
    for t in out:
        value, note = at_floor.get(t["figure"], (None, ""))
        t["floor"], t["floor_note"] = value, note
        # Does the floor alone (the same server and client, no gate) meet the goal? Where it does not,
        # the goal is not reachable on this stack, and the floor's figure is the one that is.
        t["floor_met"] = None if value is None or t["limit"] is None else value <= t["limit"]
    return out


def sse_split(rows: list[dict], path: str) -> tuple[float, float] | None:
    """(µs CPU per relayed event, µs per SSE request apart from its events) of ``path``: the slope and
    intercept of CPU per request between the 100- and the 1,000-event streams at saturation."""
    short, long = find(rows, path, "saturation", "sse"), find(rows, path, "saturation", "sse-long")
    if not short or not long:
        return None
    a, b = 1000 * short["cpu_s_per_1000_requests"], 1000 * long["cpu_s_per_1000_requests"]
    per_event = (b - a) / (SSE_LONG_EVENTS - SSE_EVENTS)
    return per_event, a - SSE_EVENTS * per_event


def floor_figures(
    rows: list[dict], idle: dict[str, float], floor_lags: dict[str, dict]
) -> dict[str, tuple[float | None, str]]:
    """Issue #27's figures for the sidecar's own floor (uvicorn + the sidecar's client, relaying and
    nothing else), measured in the same run, keyed by the figure's name in ``issue27``."""
    f = own_floor_name(rows)

    def us(path: str, kind: str) -> float | None:
        return _us(find(rows, path, "saturation", kind))

    def per_event(path: str) -> float | None:
        r = find(rows, path, "saturation", "sse")
        return r["cpu_s_per_1000_events"] if r else None

    fs, fp, npass = us(f, "small"), us(f, "small-passthrough"), us("nginx", "small-passthrough")
    out: dict[str, tuple[float | None, str]] = {}
    if fp and npass:
        out["CPU per pass-through request / nginx"] = (fp / npass, f"{f} {fp:.0f} us")
    if fs and fp:
        out["gate work per request (gated - pass-through)"] = (fs - fp, f"{f}: small POST - pass-through GET")
    burst = find(rows, f, "paced", "sse") or {}
    out["64 streams at once: added TTFB p50"] = (burst.get("added_ttfb_p50_ms"), f)
    out["64 streams at once: added TTFB p99"] = (burst.get("added_ttfb_p99_ms"), f)
    st = find(rows, f, "paced", "sse-staggered") or {}
    out["staggered starts: added TTFB p50"] = (st.get("added_ttfb_p50_ms"), f)
    out["staggered starts: added TTFB p99"] = (st.get("added_ttfb_p99_ms"), f)
    fe, ae, ne = per_event(f), per_event("floor"), per_event("nginx")
    if fe and ne:
        aio = f"; floor (aiohttp) {ae / ne:.2f}x" if ae and f != "floor" else ""
        out["SSE CPU per event / nginx"] = (
            fe / ne,
            f"{f} {1000 * fe:.2f} us/event, nginx {1000 * ne:.2f}{aio}",
        )
    split, nsplit = sse_split(rows, f), sse_split(rows, "nginx")
    if split:
        n = f", nginx {nsplit[0]:.2f}" if nsplit else ""
        out["  SSE relay alone: CPU per event (slope)"] = (split[0], f"{f}{n}")
        out["  SSE request apart from its events (intercept)"] = (split[1], f)
    paced = floor_lags.get("paced", {})
    if paced.get("samples"):
        out["event-loop stall while signals poll, paced"] = (
            paced.get("max_ms"), f"{f} (no pollers), p99 {fmt(paced.get('p99_ms'))} ms, "
            f"{paced.get('over_5ms')} over 5 ms, own CPU in one tick max {fmt(paced.get('busy_max_ms'))} ms, "
            f"longest gc pause {fmt(paced.get('gc_max_ms'))} ms")  # fmt: skip
    if f in idle:
        out["sidecar idle CPU (pollers; the bench's lag probe off)"] = (
            idle[f],
            f"{f}: no pollers, no probe while idle",
        )
    sat = find(rows, f, "saturation", "small")
    if sat:
        out["saturation, gated small: p99 TTFB"] = (sat["ttfb_p99_ms"], f"{f}, small POST")
    return out


def _issue27_figures(
    rows: list[dict], lags: dict[str, dict], idle: dict[str, float], micro: dict | None, held: list[dict]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def goal(
        figure: str, value: float | None, limit: float | None, unit: str, note: str = "", was: str = ""
    ) -> None:
        met = None if value is None or limit is None else value <= limit
        out.append({"figure": figure, "value": value, "limit": limit, "unit": unit, "met": met, "note": note,
                    "was": ISSUE27_WAS.get(was, "")})  # fmt: skip

    def sat(path: str, kind: str) -> dict | None:
        return find(rows, path, "saturation", kind)

    floors = sorted({r["path"] for r in rows if r["path"].startswith("floor")})
    own_floor = own_floor_name(rows)
    g, p, ng, fl = (
        sat("sidecar", "small"),
        sat("sidecar", "small-passthrough"),
        sat("nginx", "small"),
        sat(own_floor, "small"),
    )
    gu, pu, ngu, flu = _us(g), _us(p), _us(ng), _us(fl)
    note = f"{gu:.0f} us, {gu / ngu:.1f}x nginx" if gu and ngu else ""
    goal("CPU per gated small request / floor", gu / flu if gu and flu else None, 1.2, "x",
         f"{note}; floor = {own_floor} {flu:.0f} us" if flu else note, "gated")  # fmt: skip
    for f in floors:
        fu = _us(sat(f, "small"))
        if f != own_floor and gu and fu:
            goal(f"  (gated small / {f})", gu / fu, None, "x", f"{f} {fu:.0f} us")
    png = _us(sat("nginx", "small-passthrough"))
    goal("CPU per pass-through request / nginx", pu / png if pu and png else None, 4.05, "x",
         f"{pu:.0f} us (keep: no worse than filed)" if pu else "", "pass")  # fmt: skip
    goal("gate work per request (gated - pass-through)", gu - pu if gu and pu else None, 60, "us",
         f"decide() p50 {micro['p50_us']:.1f} us in-process" if micro else "", "gate")  # fmt: skip
    b = find(rows, "sidecar", "paced", "sse") or {}
    goal("64 streams at once: added TTFB p50", b.get("added_ttfb_p50_ms"), 2, "ms", was="burst")
    goal("64 streams at once: added TTFB p99", b.get("added_ttfb_p99_ms"), 5, "ms", was="burst")
    bf = find(rows, own_floor_name(rows), "paced", "sse") or {}
    if bf:
        f50, f99 = bf.get("added_ttfb_p50_ms"), bf.get("added_ttfb_p99_ms")
        goal(
            "  (the floor under the same bursts: p50)",
            f50,
            None,
            "ms",
            f"{own_floor_name(rows)}, p99 {fmt(f99)} ms",
        )
    st = find(rows, "sidecar", "paced", "sse-staggered") or {}
    goal("staggered starts: added TTFB p50", st.get("added_ttfb_p50_ms"), 1, "ms", "keep", "staggered")
    goal("staggered starts: added TTFB p99", st.get("added_ttfb_p99_ms"), 5, "ms", "keep", "staggered")
    sse, nsse = sat("sidecar", "sse"), sat("nginx", "sse")
    ratio = (
        sse["cpu_s_per_1000_events"] / nsse["cpu_s_per_1000_events"]
        if sse and nsse and nsse["cpu_s_per_1000_events"]
        else None
    )
    goal("SSE CPU per event / nginx", ratio, 2, "x", was="sse")
    split, nsplit = sse_split(rows, "sidecar"), sse_split(rows, "nginx")
    if split:
        # Where the sidecar's SSE CPU goes: the relay per event, or each request's own work spread
        # over its 100 events (the gate's, as in the gated small request).
        goal(
            "  SSE relay alone: CPU per event (slope)",
            split[0],
            None,
            "us",
            f"{SSE_EVENTS} vs {SSE_LONG_EVENTS:,}-event streams"
            + (f"; nginx {nsplit[0]:.2f} us" if nsplit else ""),
        )
        goal("  SSE request apart from its events (intercept)", split[1], None, "us",
             f"/ {SSE_EVENTS} events = {split[1] / SSE_EVENTS:.2f} us per event of the 100")  # fmt: skip
    paced, idle_lag = lags.get("paced", {}), lags.get("idle", {})
    goal(
        "event-loop stall while signals poll, paced",
        paced.get("max_ms"),
        5,
        "ms",
        f"loop's own CPU in one tick: max {fmt(paced.get('busy_max_ms'))} ms paced, "
        f"{fmt(idle_lag.get('busy_max_ms'))} ms idle (the pollers alone)"
        if "busy_max_ms" in paced
        else "",
        was="stall",
    )
    goal("sidecar idle CPU (pollers; the bench's lag probe off)", idle.get("sidecar"), 10, "ms/s", was="idle")
    ngp99 = ng["ttfb_p99_ms"] if ng else None
    goal("saturation, gated small: p99 TTFB", g["ttfb_p99_ms"] if g else None, None, "ms",
         f"nginx {ngp99:.2f} ms; goal: bounded by an operator's limit, answered, not queued" if ngp99 else "",
         "saturation")  # fmt: skip
    if held:
        out += held
    else:
        for figure in ("2,000 held released: admissions/s", "/healthz p99 while 2,000 are held",
                       "10,000 arriving clients: answered"):  # fmt: skip
            goal(figure, None, None, "", "bench/hold_queue.py not run (not present, or --no-hold-queue)")
    return out


def own_floor_name(rows: list[dict]) -> str:
    """The sidecar's floor: its own server (uvicorn) with its own client; the aiohttp floor where that
    is all there is (an older run, ``--floors ''``)."""
    return "floor-uvicorn" if any(r["path"] == "floor-uvicorn" for r in rows) else "floor"


def hold_queue_figures(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The hold-queue rows of issue #27 from ``bench/hold_queue.py`` when it is there (run after this
    benchmark's servers are gone, ``--quick`` with this run's): its ``issue27_figures(quick)`` if it
    offers one, else its own run read back from its JSON. Absent, or failing, the rows say so and the
    run goes on."""
    path = Path(__file__).resolve().parent / "hold_queue.py"
    if not path.exists():
        return []
    try:
        import hold_queue  # bench/ is on sys.path (beside this file)

        if hasattr(hold_queue, "issue27_figures"):
            return list(hold_queue.issue27_figures(quick=args.quick))
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "hold-queue.json"
            print("\nbench/hold_queue.py" + (" --quick" if args.quick else ""), flush=True)
            hold_queue.main((["--quick"] if args.quick else []) + ["--json", str(out)])
            return hold_queue_rows(json.loads(out.read_text()))
    except Exception as e:  # a sibling benchmark's failure must not lose this run's figures
        return [{"figure": "bench/hold_queue.py", "value": None, "limit": None, "unit": "", "met": None,
                 "note": f"failed: {type(e).__name__}: {e}", "was": ""}]  # fmt: skip


def hold_queue_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue #27's hold-queue figures from ``bench/hold_queue.py``'s JSON, with their goals."""
    a = res.get("args", {})
    n, m = a.get("held", 0), a.get("arrivals", 0)
    rate, p99, answered = res.get("admissions_per_s"), res.get("healthz_p99_ms"), res.get("arrivals_answered")
    return [
        {"figure": f"{n:,} held released: admissions/s", "value": rate, "limit": None, "unit": "/s",
         "met": None if rate is None else rate >= 500, "note": f"goal >= 500; {a.get('in_flight')} at a time",
         "was": "~9/s (2,000 held, 2-core)"},
        {"figure": f"/healthz p99 while {res.get('held_reached', 0):,} are held", "value": p99, "limit": 50,
         "unit": "ms", "met": None if p99 is None else p99 <= 50, "note": "", "was": "1.57 s (2-core)"},
        {"figure": f"{m:,} clients arriving to be held: answered", "value": answered, "limit": None, "unit": "",
         "met": None if answered is None else answered == m, "note": f"goal: all; {res.get('arrivals_statuses')}",
         "was": "3,274 held, 6,722 no answer (10,000)"},
    ]  # fmt: skip


def print_issue27(goals: list[dict[str, Any]], warning: str | None = None) -> None:
    """Issue #27's figures with their goals, then beside the floor's. ``warning``: a line put under the
    heading (``host_speed.warning``: the host changed speed during the run)."""
    print("\nissue #27 (every figure with its goal; 'was' = when the issue was filed, H100 host --quick)")
    if warning:
        print("  " + warning)
    for t in goals:
        state = {True: "met", False: "NOT MET", None: "-"}[t["met"]]
        limit = "" if t["limit"] is None else f"goal <= {t['limit']:g}"
        print(f"  {t['figure']:48} {fmt(t['value']):>9} {t['unit']:5} {limit:12} {state:8} {t['note']}"
              + (f"  [was {t['was']}]" if t.get("was") else ""))  # fmt: skip
    print_floors(goals)


def print_floors(goals: list[dict[str, Any]]) -> None:
    """Each of issue #27's figures beside the same figure for the stack's floor (its server and client,
    no gate), measured in this run: where the floor alone misses a goal, the goal is not reachable on
    this stack, and the floor's figure is the one that is."""
    rows = [t for t in goals if t.get("floor") is not None]
    if not rows:
        return
    print("\nissue #27 at the stack's floor (the same figure, same run, no gate; 'floor alone' = whether the")
    print("floor meets the goal: where it does not, the goal is beyond this stack and the floor's figure is")
    print("the one that is)")
    print(
        f"  {'figure':48} {'sidecar':>9} {'floor':>9} {'unit':5} {'goal':>6}  {'floor alone':12} floor's note"
    )
    for t in rows:
        limit = "" if t["limit"] is None else f"{t['limit']:g}"
        alone = {True: "meets it", False: "MISSES IT", None: "-"}[t["floor_met"]]
        print(f"  {t['figure']:48} {fmt(t['value']):>9} {fmt(t['floor']):>9} {t['unit']:5} {limit:>6}  {alone:12} "
              f"{t['floor_note']}")  # fmt: skip


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
