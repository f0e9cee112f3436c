"""Where the gated small request's CPU goes, in-process: the real app, no HTTP server in front of it.

The sidecar's ASGI app (built as ``serve`` builds it: the overhead benchmark's policy, a decision log
written to ``/dev/null``) is called directly, one request at a time, against ``bench/upstream.py``
under uvicorn in a subprocess. The process CPU of N requests, gated (``POST /generate``) and
pass-through (``GET /v1/models``), is read with ``time.process_time``: the upstream client's cost is
in both and cancels out of the difference, which is the gate's work per request.

Two trees are compared in one run (``--base DIR``: another checkout, e.g. ``git archive`` of main),
each request kind measured in a fresh child per round, trees interleaved, medians reported; then one
``cProfile`` of the gated path per tree, whose top entries go to the report. Each round first times a
fixed Python loop (``bench/host_speed.py``); the report says whether the host kept its speed.

    PYTHONPATH=$PWD python bench/gate_profile.py --base /tmp/base --out bench/results/gate-profile-2core.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import logging
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_speed  # noqa: E402  (bench/ is not a package: imported from beside this file)

SMALL_BODY = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}}).encode()
# ``sse``: a gated streaming request of 100 events (overhead.py's ``sse`` shape), to set its per-request
# cost beside the small request's: the difference is what a stream adds apart from relaying its events.
SSE_EVENTS = 100
SSE_BODY = json.dumps(
    {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": SSE_EVENTS}}
).encode()
KINDS = ("gated", "pass", "sse")
BODIES = {"gated": SMALL_BODY, "sse": SSE_BODY, "pass": b""}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scope(kind: str) -> dict[str, Any]:
    gated = kind != "pass"
    hdrs = [(b"host", b"127.0.0.1:8000")]
    if gated:
        hdrs += [(b"content-type", b"application/json"), (b"content-length", str(len(BODIES[kind])).encode())]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST" if gated else "GET",
        "scheme": "http",
        "path": "/generate" if gated else "/v1/models",
        "raw_path": b"/generate" if gated else b"/v1/models",
        "query_string": f"events={SSE_EVENTS}".encode() if kind == "sse" else b"",
        "root_path": "",
        "headers": hdrs,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def _one(app: Any, kind: str) -> int:
    status = [0]
    sent_body = [False]

    async def receive() -> dict[str, Any]:
        if not sent_body[0]:
            sent_body[0] = True
            return {"type": "http.request", "body": BODIES[kind], "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the request ends first
        raise AssertionError

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            status[0] = msg["status"]

    await app(_scope(kind), receive, send)
    return status[0]


async def _child(upstream: str, kind: str, n: int, profile: bool) -> dict[str, Any]:
    # GATE_NO_DECISION_LOG=1: no decision log at all (what the log's record costs, by difference)
    async with running_app(upstream, decision_log=not os.environ.get("GATE_NO_DECISION_LOG")) as app:
        return await _measure_child(app, kind, n, profile)


@contextlib.asynccontextmanager
async def running_app(upstream: str, *, decision_log: bool = True) -> AsyncIterator[Any]:
    """The sidecar's ASGI app as ``serve`` builds it for these benchmarks (the overhead benchmark's
    policy, a GPU file with 100 GiB free, a decision log written to ``/dev/null`` unless
    ``decision_log`` is False), its lifespan started and the engine read; shut down on exit."""
    from sidecar.app import SidecarApp
    from sidecar.ops.decision_file import DecisionFile
    from sidecar.policy.schema import load_policy_text
    from sidecar.signals.gpu import parse_gpu_source

    sys.path.insert(0, str(ROOT))
    from bench.overhead import POLICY

    tmp = Path(tempfile.mkdtemp())
    gpu_file = tmp / "gpu.json"
    gpu_file.write_text(json.dumps({"free_bytes": 100 << 30, "total_bytes": 141 << 30}))
    app = SidecarApp(
        upstream=upstream,
        policy=load_policy_text(POLICY, "policy.yaml"),
        gpu_source=parse_gpu_source(f"file:{gpu_file}"),
        decision_log=DecisionFile(os.devnull, 0, 0) if decision_log else None,
    )
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    life = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    deadline = time.monotonic() + 20
    while app.admission.snapshot.engine is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert app.admission.snapshot.engine is not None, "the engine was not read in 20 s"
    try:
        yield app
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await life


async def _measure_child(app: Any, kind: str, n: int, profile: bool) -> dict[str, Any]:
    """A child's N requests of ``kind`` on a running app (``running_app``): CPU per request, the
    collector's passes, and the phases or the profile where asked."""
    phases = _time_phases() if os.environ.get("GATE_PHASES") else None
    for _ in range(300):  # warm: connections, caches
        assert await _one(app, kind) == 200
    if phases is not None:
        phases.update(dict.fromkeys(phases, 0))
    import gc

    if os.environ.get("GATE_GC_THRESHOLD"):  # what the serve process would run with (issue #27)
        gc.set_threshold(*(int(x) for x in os.environ["GATE_GC_THRESHOLD"].split(",")))
    gc.collect()
    gc.freeze()  # as ``serve`` does after start-up
    collections0 = [g["collections"] for g in gc.get_stats()]
    # CPU time, not wall: on a shared machine wall time is mostly other processes' turn.
    prof = cProfile.Profile(time.process_time) if profile else None
    # GATE_CHUNKS=k: the n requests in k chunks, the cheapest chunk's figure reported (a chunk that
    # shared the cores with another process costs more CPU, never less: the least is the least noisy).
    chunks = max(1, int(os.environ.get("GATE_CHUNKS", "1")))
    cpu_per: list[float] = []
    if prof:
        prof.enable()
    for c in range(chunks):
        t0 = time.process_time()
        size = n // chunks + (c < n % chunks)
        for _ in range(size):
            await _one(app, kind)
        cpu_per.append((time.process_time() - t0) / size)
    if prof:
        prof.disable()
    out: dict[str, Any] = {"kind": kind, "n": n, "cpu_us_per_request": 1e6 * min(cpu_per)}
    out["gc_collections_per_1000"] = [
        round(1000 * (g["collections"] - c0) / n, 1)
        for g, c0 in zip(gc.get_stats(), collections0, strict=True)
    ]
    if phases is not None:
        out["phases_us"] = {k: v / 1000 / n for k, v in phases.items()}
    if prof and os.environ.get("GATE_PROFILE_DUMP"):
        prof.dump_stats(os.environ["GATE_PROFILE_DUMP"])  # for pstats' callers/callees by hand
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out["profile_tottime"] = s.getvalue()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
        out["profile_cumulative"] = s.getvalue()
    return out


# The gate's pieces, timed in the loop's thread (CPU, not wall: an awaited upstream costs nothing here).
# Each is a (module, attribute) called through that attribute; nested pieces are inside their parents.
PHASES = (
    ("sidecar.http.proxy", "read_body"),
    ("sidecar.http.proxy", "parse_generation"),
    ("sidecar.http.proxy", "_headers_dict"),
    ("sidecar.http.proxy", "demand_of"),
    ("sidecar.http.proxy.Proxy", "_gateway_fields"),
    ("sidecar.http.proxy.Proxy", "_upstream_target"),
    ("sidecar.http.proxy", "_response_headers"),
    ("sidecar.intake.tokens.PromptCounter", "count"),
    ("sidecar.intake.tokens.PromptCounter", "count_now"),
    ("sidecar.admission.controller.Handle", "submit"),
    ("sidecar.admission.controller", "decide"),
    ("sidecar.admission.controller.Admission", "situation"),
    ("sidecar.admission.controller.Admission", "_admit"),
    ("sidecar.admission.lane_watch.LaneWatch", "charged"),
    ("sidecar.ops.telemetry.Telemetry", "decision"),
    ("sidecar.ops.telemetry.Telemetry", "outcome"),
    ("sidecar.ops.telemetry", "decision_record"),
    ("sidecar.admission.controller.Handle", "prefill_done"),
    ("sidecar.admission.controller", "final_bytes"),
    ("sidecar.admission.controller.Handle", "__exit__"),
    ("sidecar.http.access_log.AccessLog", "_log"),
    # The next three exist only in trees before the third cut of issue #27 (a missing one is skipped).
    ("sidecar.http.proxy", "_header_problem"),
    ("sidecar.http.proxy", "json_body_refusal"),
    ("sidecar.http.proxy", "_client_request_id"),
    ("sidecar.http.proxy", "new_request_id"),
    ("sidecar.http.proxy.Proxy", "_decide"),
    ("sidecar.http.proxy.Proxy", "_forward"),
    ("sidecar.http.proxy.Proxy", "__call__"),
)


def _time_phases() -> dict[str, int]:
    """Wrap each of ``PHASES`` with a thread-CPU timer; the returned dict fills as requests run.
    A wrapper costs ~0.3 µs per call: read the figures as where the time goes, not as exact times."""
    import importlib
    import inspect

    acc: dict[str, int] = {}
    clock = time.thread_time_ns

    def wrap(name: str, fn: Any) -> Any:
        acc[name] = 0
        if inspect.iscoroutinefunction(fn):

            async def timed_async(*a: Any, **k: Any) -> Any:
                t0 = clock()
                try:
                    return await fn(*a, **k)
                finally:
                    acc[name] += clock() - t0

            return timed_async

        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += clock() - t0

        return timed

    for where, attr in PHASES:
        mod, _, cls = where.rpartition(".") if where.rsplit(".", 1)[-1][:1].isupper() else (where, "", "")
        owner: Any = importlib.import_module(mod)
        if cls:
            owner = getattr(owner, cls)
        fn = getattr(owner, attr, None)
        if fn is not None:
            setattr(owner, attr, wrap(f"{cls or mod.rsplit('.', 1)[-1]}.{attr}", fn))
    return acc


def _run_child(
    tree: str, upstream: str, kind: str, n: int, profile: bool = False, phases: bool = False
) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": tree} | ({"GATE_PHASES": "1"} if phases else {})
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        kind,
        "--upstream",
        upstream,
        "-n",
        str(n),
    ]
    res = subprocess.run(args + (["--profile"] if profile else []), env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-3000:])
        raise SystemExit(f"child failed in {tree}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def start_upstream() -> tuple[subprocess.Popen[bytes], str]:
    """``bench/upstream.py`` under uvicorn on a free port, up and answering: the process and its URL."""
    port = _free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bench.upstream:app", "--port", str(port), "--log-level", "warning",
         "--no-access-log"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url + "/health")
    except BaseException:
        up.terminate()
        raise
    return up, url


def _wait_up(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _phase_table(phased: dict[str, dict[str, Any]]) -> list[str]:
    """The pieces' loop-thread CPU per gated request, one column per tree (nested pieces included in
    their parents: ``Handle.submit`` holds ``decide``, ``_admit``; ``_admit`` holds ``Telemetry.decision``)."""
    names = list(dict.fromkeys(k for r in phased.values() for k in r["phases_us"]))
    out = ["", "| piece (µs thread CPU per gated request, timers on) | " + " | ".join(phased) + " |"]
    out.append("|---|" + "---|" * len(phased))
    for k in names:
        out.append(
            f"| `{k}` | " + " | ".join(f"{r['phases_us'].get(k, 0):.1f}" for r in phased.values()) + " |"
        )
    out.append("| whole request (process CPU, timers on) | " + " | ".join(
        f"{r['cpu_us_per_request']:.0f}" for r in phased.values()) + " |")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=KINDS)
    ap.add_argument("--upstream")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--base", help="another checkout to compare with (before); default: this one only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile-kind", choices=KINDS, default="gated", help="the kind cProfile'd per tree")
    ap.add_argument(
        "--sse", action="store_true",
        help=f"also a gated stream of {SSE_EVENTS} events per round: what a stream adds per request",
    )  # fmt: skip
    ap.add_argument("--phases", action="store_true", help="also time the gate's pieces (PHASES) per tree")
    ap.add_argument("--labels", default="after,before", help="names of this tree and --base's in the report")
    ap.add_argument(
        "--chunks",
        type=int,
        default=1,
        help="measure each child's N requests in this many chunks and take the cheapest chunk's CPU per "
        "request (on a shared machine, interference only adds CPU)",
    )
    args = ap.parse_args(argv)
    os.environ["GATE_CHUNKS"] = str(args.chunks)  # the children read it
    if args.child:
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(asyncio.run(_child(args.upstream, args.child, args.n, args.profile))))
        return 0

    mine, theirs = args.labels.split(",")
    trees = {mine: str(ROOT)} | ({theirs: args.base} if args.base else {})
    up, upstream = start_upstream()
    try:
        kinds = KINDS if args.sse else ("gated", "pass")
        cpu: dict[tuple[str, str], list[float]] = {(t, k): [] for t in trees for k in kinds}
        speed = host_speed.Readings()
        for r in range(args.rounds):
            speed.take(f"round {r + 1}")
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for tree in order:
                for kind in kinds:
                    cpu[tree, kind].append(
                        _run_child(trees[tree], upstream, kind, args.n)["cpu_us_per_request"]
                    )
            print(
                f"round {r + 1}: " + ", ".join(f"{t}/{k} {v[-1]:.0f}" for (t, k), v in cpu.items()),
                flush=True,
            )
        profiles = {t: _run_child(trees[t], upstream, args.profile_kind, args.n, profile=True) for t in trees}
        phased = (
            {t: _run_child(trees[t], upstream, "gated", args.n, phases=True) for t in trees}
            if args.phases
            else {}
        )
    finally:
        up.terminate()
        up.wait(10)
    med = {key: statistics.median(v) for key, v in cpu.items()}
    per = f", the cheapest of {args.chunks} chunks per child" if args.chunks > 1 else ""
    lines = [
        f"- rounds: {args.rounds}, {args.n} sequential requests per child{per}, medians (µs CPU per request)",
        "",
    ]
    sse = f" | sse ({SSE_EVENTS} events) | sse - gated" if args.sse else ""
    lines += [
        f"| tree | gated | pass-through | gate work (gated - pass){sse} |",
        "|---" * (6 if sse else 4) + "|",
    ]
    for t in trees:
        g, p = med[t, "gated"], med[t, "pass"]
        more = f" | {med[t, 'sse']:.0f} | {med[t, 'sse'] - g:.0f}" if args.sse else ""
        lines.append(f"| {t} | {g:.0f} | {p:.0f} | {g - p:.0f}{more} |")
    if args.base:
        work = {t: med[t, "gated"] - med[t, "pass"] for t in trees}
        lines += [
            "",
            f"- gated {mine}/{theirs}: {med[mine, 'gated'] / med[theirs, 'gated']:.3f}; "
            f"gate work {mine}/{theirs}: {work[mine] / work[theirs]:.3f}",
        ]
    lines += ["", "raw: " + json.dumps({f"{t}/{k}": [round(x) for x in v] for (t, k), v in cpu.items()})]
    lines += ["", speed.line()]
    warning = speed.warning()
    if warning is not None:  # before any figure, where a reader starts
        lines = [warning, "", *lines]
    if phased:
        lines += _phase_table(phased)
    report = "\n".join(lines)
    print(report)
    if args.out:
        body = [report]
        for t, prof in profiles.items():
            body += [
                f"\n## cProfile, {args.profile_kind} path, {t}: by own time\n",
                "```",
                prof["profile_tottime"].strip(),
                "```",
            ]
            body += [
                f"\n## cProfile, {args.profile_kind} path, {t}: cumulative\n",
                "```",
                prof["profile_cumulative"].strip(),
                "```",
            ]
        args.out.write_text("\n".join(body) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
