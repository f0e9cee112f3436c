"""What the sidecar costs on the data path, as ratios against talking to the upstream directly.

Starts ``bench/upstream.py`` and ``sglang-sidecar serve`` in front of it as separate processes on
loopback, then measures, in the same run: small requests per second and latency (direct, through the
sidecar on an ungated path, through the gate), and SSE relay throughput and the sidecar's CPU per
1,000 events. On a 2-core machine the load generator, the sidecar and the upstream share the cores, so
absolute numbers are low; the ratios are the result. Prints a table, writes JSON to bench/results/.

    .venv/bin/python bench/proxy_overhead.py [--seconds 5] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
POLICY = """
name: bench
lane: {context_len: 100000, chunked_prefill_size: 8192}
cost: {activation_bytes_per_chunk_token: 1KiB}
engine_queue: {max_requests: 100000}
pending_prefill: {max_tokens: 100000000}
engine: {poll_interval_s: 0.5, max_age_s: 30, on_stale: admit}
gpu: {poll_interval_s: 0.5, max_age_s: 30, on_stale: admit, required: false}
hold: {max_held: 1000, max_wait_s: 60}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} never came up")


async def load(url: str, method: str, body: dict | None, seconds: float, concurrency: int) -> dict:
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    async with s.request(method, url, json=body) as r:
                        await r.read()
                        if r.status != 200:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    latencies.sort()
    return {
        "requests_per_s": len(latencies) / seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "errors": errors,
    }


async def sse(url: str, events: int, streams: int) -> dict:
    async with aiohttp.ClientSession() as s:

        async def one() -> int:
            n = 0
            async with s.post(url, json={"text": "x", "stream": True, "events": events}) as r:
                async for chunk in r.content.iter_any():
                    n += chunk.count(b"\n\n")
            return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(streams)))
        dt = time.perf_counter() - t0
    return {"events_per_s": sum(counts) / dt, "events": sum(counts)}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=16)
    args = ap.parse_args()
    up_port, sc_port = free_port(), free_port()
    up_url, sc_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{sc_port}"
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "bench.yaml"
        policy.write_text(POLICY)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "bench.upstream:app",
                    "--port",
                    str(up_port),
                    "--log-level",
                    "warning",
                    "--no-access-log",
                ],
                cwd=ROOT,
                env=env,
            )
        )
        sidecar = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sidecar",
                "serve",
                "--upstream",
                up_url,
                "--listen",
                f"127.0.0.1:{sc_port}",
                "--policy",
                str(policy),
                "--decision-log",
                os.devnull,
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=env,
        )
        procs.append(sidecar)
        try:
            asyncio.run(wait_up(up_url + "/health"))
            asyncio.run(wait_up(sc_url + "/healthz"))
            time.sleep(1.0)
            small = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
            rows = {
                "direct GET /v1/models": asyncio.run(
                    load(up_url + "/v1/models", "GET", None, args.seconds, args.concurrency)
                ),
                "sidecar GET /v1/models (passthrough)": asyncio.run(
                    load(sc_url + "/v1/models", "GET", None, args.seconds, args.concurrency)
                ),
                "direct POST /generate": asyncio.run(
                    load(up_url + "/generate", "POST", small, args.seconds, args.concurrency)
                ),
                "sidecar POST, same body, not gated": asyncio.run(
                    load(sc_url + "/generate_ungated", "POST", small, args.seconds, args.concurrency)
                ),
                "sidecar POST /generate (gated)": asyncio.run(
                    load(sc_url + "/generate", "POST", small, args.seconds, args.concurrency)
                ),
            }
            direct_sse = asyncio.run(sse(up_url + "/generate", args.events, args.streams))
            cpu0 = cpu_seconds(sidecar.pid)
            proxied_sse = asyncio.run(sse(sc_url + "/generate", args.events, args.streams))
            sidecar_cpu = cpu_seconds(sidecar.pid) - cpu0
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)
    base_models, base_gen = rows["direct GET /v1/models"], rows["direct POST /generate"]
    print(
        f"proxy overhead: {args.concurrency} concurrent clients, {args.seconds:g} s each, {os.cpu_count()} cores"
    )
    print(f"{'':40}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}{'vs direct':>11}")
    for name, r in rows.items():
        base = base_models if "models" in name else base_gen
        print(
            f"{name:40}{r['requests_per_s']:10.0f}{r['p50_ms']:10.2f}{r['p99_ms']:10.2f}{r['errors']:8d}"
            f"{r['requests_per_s'] / base['requests_per_s']:10.2f}x"
        )
    ratio = proxied_sse["events_per_s"] / direct_sse["events_per_s"]
    per_k = 1000 * sidecar_cpu / max(1, proxied_sse["events"])
    print(
        f"\nSSE, {args.streams} streams x {args.events} events: direct {direct_sse['events_per_s']:,.0f} ev/s, "
        f"through the sidecar {proxied_sse['events_per_s']:,.0f} ev/s ({ratio:.2f}x); "
        f"sidecar CPU {per_k * 1000:.1f} ms per 1,000 events"
    )
    out = ROOT / "bench" / "results" / "proxy_overhead.json"
    out.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "cores": os.cpu_count(),
                "args": vars(args),
                "rows": rows,
                "sse_direct": direct_sse,
                "sse_sidecar": proxied_sse,
                "sidecar_cpu_ms_per_1000_events": per_k * 1000,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
