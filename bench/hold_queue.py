"""The hold queue at scale and the sidecar's idle cost (issue #27, items 3 and 4), on 127.0.0.1.

Processes: the constant-cost upstream (``bench/upstream.py``, answers at once), the real
``sglang-sidecar serve`` (no probe inside it: its CPU is its own), and client processes that speak raw
HTTP/1.1 over asyncio streams (one connection per client, ``Connection: close``), so a client either
reads a status line (answered) or does not (reset, closed, timed out: not answered).

The lever that holds and releases: the sidecar's GPU source is a file. Free memory 0 holds every gated
request (``vram_headroom``); writing a large figure releases them. The policy's
``engine_queue.max_requests`` (``--in-flight``, default 4) lets only that many prefills be admitted at a
time, so the queue drains at the engine's pace: each first byte frees a slot and the gate must find
the next request (the cost per event under test).

Phases, each bounded in count and time, printed as one table with the goals:

1. idle: the sidecar's CPU, ms per s, nothing held, nothing arriving (pollers only);
2. hold ``--held`` clients (default 2,000); while they are held: ``/healthz`` p50/p99 over 200
   sequential probes on the data port, and the sidecar's CPU per second with them held;
3. release them: admissions/s (clients answered 200 / seconds from the release to the last answer);
4. ``--arrivals`` clients (default 10,000) arriving at once, spread over ``--procs`` processes, with
   ``hold.max_held`` = ``--held``: how many got any HTTP answer (held then admitted, or a 503), by status.

    .venv/bin/python bench/hold_queue.py [--quick] [--json out.json]

Exit status 0 whatever the figures (it measures; it does not judge). Runs in about a minute on a quiet
host, within ``--budget-s`` (default 170) anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BODY = b'{"text":"hi","sampling_params":{"max_new_tokens":1}}'
FREE_HELD = {"free_bytes": 0, "total_bytes": 141 << 30}
FREE_OPEN = {"free_bytes": 100 << 30, "total_bytes": 141 << 30}

POLICY = """
name: hold-queue-bench
description: every gate open but the GPU's free memory (the file) and {in_flight} prefills at a time
lane: {{context_len: 1048576, chunked_prefill_size: 8192}}
cost: {{activation_bytes_per_chunk_token: 1KiB, context_bytes_per_token: 1}}
engine_queue: {{max_requests: {in_flight}}}
pending_prefill: {{max_tokens: 1000000000}}
engine: {{poll_interval_s: 0.5, max_age_s: 30, on_stale: admit}}
gpu: {{poll_interval_s: 0.1, max_age_s: 30, on_stale: admit, required: false}}
hold: {{max_held: {max_held}, max_wait_s: 120}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` (all its threads)."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def os_limits() -> dict[str, Any]:
    """Raise this process's descriptor limit to its hard limit (children inherit it); what the OS allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out: dict[str, Any] = {"nofile_soft_was": soft, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
    for name, path in (
        ("somaxconn", "/proc/sys/net/core/somaxconn"),
        ("tcp_max_syn_backlog", "/proc/sys/net/ipv4/tcp_max_syn_backlog"),
        ("ip_local_port_range", "/proc/sys/net/ipv4/ip_local_port_range"),
    ):
        with contextlib.suppress(OSError):
            out[name] = Path(path).read_text().strip().replace("\t", "-")
    out["cpus"] = os.cpu_count()
    return out


# -- the client side (worker processes) -------------------------------------------------------------


async def _one(host: str, port: int, path: str, timeout_s: float) -> tuple[int | None, float]:
    """One request on its own connection: (status or None when no answer came, monotonic time of it)."""
    req = (
        b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (path.encode(), host.encode(), port, len(BODY), BODY)
    )
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(req)
            line = await reader.readline()
            at = time.monotonic()
            if not line.startswith(b"HTTP/1."):
                return None, at
            status = int(line.split()[1])
            await reader.read()  # the rest, to the close: the answer is complete
            return status, at
    except (OSError, TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError):
        return None, time.monotonic()
    finally:
        if writer is not None:
            writer.close()


async def _clients(host: str, port: int, n: int, timeout_s: float) -> list[tuple[int | None, float]]:
    return await asyncio.gather(*(_one(host, port, "/generate", timeout_s) for _ in range(n)))


def client_proc(host: str, port: int, n: int, timeout_s: float, go: Any, out: Any) -> None:
    go.wait()
    out.put(asyncio.run(_clients(host, port, n, timeout_s)))


def spawn_clients(port: int, n: int, procs: int, timeout_s: float) -> tuple[Any, list[Any], Any]:
    # Each client holds a descriptor: enough processes that none needs more than its limit allows.
    per_proc = max(1, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64)
    procs = max(procs, -(-n // per_proc))
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    shares = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    ps = [
        ctx.Process(target=client_proc, args=("127.0.0.1", port, k, timeout_s, go, out), daemon=True)
        for k in shares
        if k
    ]
    for p in ps:
        p.start()
    return go, ps, out


def collect(ps: list[Any], out: Any, deadline: float) -> list[tuple[int | None, float]]:
    results: list[tuple[int | None, float]] = []
    for _ in ps:
        with contextlib.suppress(Exception):
            results += out.get(timeout=max(0.1, deadline - time.monotonic()))
    for p in ps:
        p.join(1)
        if p.is_alive():
            p.kill()
    return results


# -- the sidecar's side ------------------------------------------------------------------------------


async def _get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    host, _, rest = url.removeprefix("http://").partition("/")
    h, _, p = host.partition(":")
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(h, int(p))
        writer.write(
            b"GET /%s HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n\r\n" % (rest.encode(), host.encode())
        )
        data = await reader.read()
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    return asyncio.run(_get(url, timeout_s))


def held_now(admin: str) -> int:
    _, body = get(admin + "/metrics", 10.0)
    m = re.search(rb"^\w*held_requests(?:\{[^}]*\})? (\S+)$", body, re.M)
    return int(float(m.group(1))) if m else -1


def seen_now(admin: str) -> int:
    """Gated requests held now plus those that ended (``requests_total``, every outcome)."""
    _, body = get(admin + "/metrics", 10.0)
    ended = sum(float(v) for v in re.findall(rb"^\w*requests_total\{[^}]*\} (\S+)$", body, re.M))
    return held_now(admin) + int(ended)


def settle(admin: str, target: int, deadline: float) -> None:
    """Until ``target`` gated requests have been seen, or nothing new for 3 s after the first, or the
    deadline."""
    first = seen_now(admin)
    last, still_since = first, time.monotonic()
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, TimeoutError, ValueError):
            seen = seen_now(admin)
            if seen >= target:
                return
            if seen != last:
                last, still_since = seen, time.monotonic()
            elif seen > first and time.monotonic() - still_since > 3:
                return
        time.sleep(0.2)


def wait_for(what: str, cond: Any, deadline: float) -> bool:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, TimeoutError, ValueError):
            if cond():
                return True
        time.sleep(0.1)
    print(f"  (gave up waiting for {what})", file=sys.stderr)
    return False


def healthz_latency(url: str, n: int) -> list[float]:
    async def probe() -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            status, _ = await _get(url + "/healthz", 10.0)
            out.append(time.perf_counter() - t0 if status == 200 else float("inf"))
        return out

    return asyncio.run(probe())


def cpu_rate(pid: int, seconds: float) -> float:
    """CPU ms per wall second of ``pid`` over ``seconds``."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return 1000 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def start(
    args: argparse.Namespace, tmp: Path, max_held: int, gpu: Path, log: Any
) -> tuple[list[Any], str, str]:
    up_port, sc_port, ad_port = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bench.upstream:app", "--port", str(up_port), "--no-access-log",
         "--log-level", "warning", "--backlog", "8192"],
        cwd=ROOT, env=env, stdout=log, stderr=log,
    )  # fmt: skip
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY.format(in_flight=args.in_flight, max_held=max_held))
    sc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", "--upstream", f"http://127.0.0.1:{up_port}",
         "--listen", f"127.0.0.1:{sc_port}", "--admin-listen", f"127.0.0.1:{ad_port}",
         "--policy", str(policy), "--gpu-source", f"file:{gpu}", "--decision-log", os.devnull,
         "--log-level", "warning", "--max-client-connections", str(args.max_connections)],
        cwd=ROOT, env=env, stdout=log, stderr=log,
    )  # fmt: skip
    url, admin = f"http://127.0.0.1:{sc_port}", f"http://127.0.0.1:{ad_port}"
    deadline = time.monotonic() + 30
    wait_for("the sidecar", lambda: get(url + "/readyz")[0] == 200, deadline)
    return [sc, up], url, admin


def stop(procs: list[Any]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def run(args: argparse.Namespace) -> dict[str, Any]:
    limits = os_limits()
    end = time.monotonic() + args.budget_s
    res: dict[str, Any] = {"limits": limits, "args": vars(args)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        gpu = tmp / "gpu.json"
        gpu.write_text(json.dumps(FREE_OPEN))
        log = (tmp / "servers.log").open("wb")
        procs, url, admin = start(args, tmp, args.held, gpu, log)
        port = int(url.rsplit(":", 1)[1])
        pid = procs[0].pid
        try:
            time.sleep(1.0)  # a few polls behind it
            res["idle_cpu_ms_per_s"] = cpu_rate(pid, args.idle_s)

            # -- hold N, probe, release ----------------------------------------------------------------
            gpu.write_text(json.dumps(FREE_HELD))
            time.sleep(0.5)  # the poller reads it (0.1 s interval)
            n = args.held
            # Half the budget for holding and releasing; the rest for the arrivals.
            half = time.monotonic() + (end - time.monotonic()) / 2
            go, ps, out = spawn_clients(port, n, args.procs, timeout_s=max(10.0, half - time.monotonic()))
            t_go = time.monotonic()
            go.set()
            held_ok = wait_for("N held", lambda: held_now(admin) >= n, min(end, time.monotonic() + 60))
            res["hold_fill_s"] = time.monotonic() - t_go
            res["held_reached"] = held_now(admin)
            lat = healthz_latency(url, args.probes)
            res["healthz_p50_ms"], res["healthz_p99_ms"] = 1000 * pct(lat, 0.5), 1000 * pct(lat, 0.99)
            res["held_cpu_ms_per_s"] = cpu_rate(pid, args.idle_s)
            t_release = time.monotonic()
            gpu.write_text(json.dumps(FREE_OPEN))
            got = collect(ps, out, half + 5)
            ok = [at for status, at in got if status == 200]
            span = (max(ok) - t_release) if ok else None
            res["released"] = len(ok)
            res["release_s"] = span
            res["admissions_per_s"] = len(ok) / span if span and held_ok else None
            res["release_statuses"] = _statuses(got, n)

            # -- M arriving at once, max_held = N ---------------------------------------------------------
            if time.monotonic() < end - 25:
                wait_for("an empty queue", lambda: held_now(admin) == 0, time.monotonic() + 10)
                gpu.write_text(json.dumps(FREE_HELD))
                time.sleep(0.5)
                m = args.arrivals
                if args.arrivals_max_held != n:  # the policy reloaded with the arrivals' bound (SIGHUP)
                    policy = tmp / "policy.yaml"
                    policy.write_text(
                        POLICY.format(in_flight=args.in_flight, max_held=args.arrivals_max_held)
                    )
                    procs[0].send_signal(signal.SIGHUP)
                    time.sleep(1.0)
                before = seen_now(admin)
                go, ps, out = spawn_clients(
                    port, m, args.procs, timeout_s=max(10.0, end - time.monotonic() - 15)
                )
                t_go = time.monotonic()
                go.set()
                # Every arrival held or answered (or nothing new for 3 s), then release the held.
                settle(admin, before + m, end - 20)
                res["arrivals_settle_s"] = time.monotonic() - t_go
                res["arrivals_held_peak"] = held_now(admin)
                gpu.write_text(json.dumps(FREE_OPEN))
                got = collect(ps, out, end - 5)
                statuses = _statuses(got, m)
                res["arrivals"] = m
                res["arrivals_statuses"] = statuses
                res["arrivals_answered"] = m - statuses.get("none", 0)
        finally:
            stop(procs)
            log.close()
            res["server_log_tail"] = (tmp / "servers.log").read_text(errors="replace")[-1500:]
    return res


def _statuses(got: list[tuple[int | None, float]], expected: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for status, _ in got:
        key = "none" if status is None else str(status)
        out[key] = out.get(key, 0) + 1
    missing = expected - len(got)
    if missing:
        out["none"] = out.get("none", 0) + missing  # a client process that did not report
    return out


def fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}"


def table(res: dict[str, Any]) -> str:
    a, lim = res["args"], res["limits"]
    n, m = a["held"], a["arrivals"]
    rows = [
        (f"admissions/s releasing {n:,} held ({a['in_flight']} at a time)", fmt(res.get("admissions_per_s")),
         ">= 500", (res.get("admissions_per_s") or 0) >= 500),
        (f"/healthz p50 while {res.get('held_reached', 0):,} held, ms", fmt(res.get("healthz_p50_ms"), 2), "-", None),
        (f"/healthz p99 while {res.get('held_reached', 0):,} held, ms", fmt(res.get("healthz_p99_ms"), 2), "<= 50",
         (res.get("healthz_p99_ms") or 1e9) <= 50),
        (f"clients answered of {m:,} arriving (max_held {a['arrivals_max_held']:,})",
         f"{fmt(res.get('arrivals_answered'))} {res.get('arrivals_statuses', '')}", f"{m:,}",
         res.get("arrivals_answered") == m),
        ("sidecar idle CPU, ms per s", fmt(res.get("idle_cpu_ms_per_s")), "<= 10", res.get("idle_cpu_ms_per_s") is not None and res["idle_cpu_ms_per_s"] <= 10),
        (f"sidecar CPU while {n:,} held, nothing moving, ms per s", fmt(res.get("held_cpu_ms_per_s")), "-", None),
    ]  # fmt: skip
    w = max(len(r[0]) for r in rows)
    lines = [f"{'figure':<{w}}  {'now':>28}  {'goal':>8}  met"]
    for name, now, goal, met in rows:
        lines.append(f"{name:<{w}}  {now:>28}  {goal:>8}  {'' if met is None else 'yes' if met else 'NO'}")
    lines.append(
        f"release: {res.get('released')} answered 200 in {fmt(res.get('release_s'), 2)} s {res.get('release_statuses')}; "
        f"hold filled in {fmt(res.get('hold_fill_s'), 2)} s; {res.get('arrivals', 0):,} arrivals seen in "
        f"{fmt(res.get('arrivals_settle_s'), 2)} s, {res.get('arrivals_held_peak')} held then"
    )
    lines.append(
        "OS limits: nofile {nofile} (was {nofile_soft_was}), somaxconn {somaxconn}, tcp_max_syn_backlog "
        "{tcp_max_syn_backlog}, ports {ip_local_port_range}, {cpus} CPUs".format(**lim)
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--held", type=int, default=2000, help="clients held, then released (and hold.max_held)")
    ap.add_argument("--arrivals", type=int, default=10_000, help="clients arriving at once in phase 4")
    ap.add_argument(
        "--arrivals-max-held",
        type=int,
        help="hold.max_held for the arrivals (default: all of them may be held; the connection cap binds)",
    )
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--in-flight", type=int, default=4, help="prefills admitted at a time (engine_queue)")
    ap.add_argument("--probes", type=int, default=200, help="sequential /healthz probes while held")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds of each CPU measurement")
    ap.add_argument(
        "--max-connections", type=int, default=4096, help="the sidecar's --max-client-connections"
    )
    ap.add_argument("--budget-s", type=float, default=170.0, help="the whole run stops within this")
    ap.add_argument("--quick", action="store_true", help="500 held, 2,000 arriving, 2 s CPU windows")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.held, args.arrivals, args.idle_s, args.probes = 500, 2000, 2.0, 100
    if args.arrivals_max_held is None:
        args.arrivals_max_held = args.arrivals
    res = run(args)
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
