"""Lanes behind SGLang's real router, on real processes: with and without sidecars, against the router's
own ``--max-concurrent-requests`` as the peer baseline.

Each setup gets fresh processes: N emulated Max-Q lanes (``sglang-sidecar emulate``, --speed 20),
a sidecar in front of each where the setup has them, and ``python -m sglang_router.launch_router``
(round robin) in front. The workload, the same for every setup: a burst of 16 requests no lane can run
(300K tokens: beyond the ~225K-token transient this lane can ever free), 8 at a time, while a mixed
chat load runs (60 requests of 1K-40K tokens, 6 at a time); then 10 small requests. Bounded: every
request has a 120 s client timeout and the whole run stops by itself.

Columns: goodput (prompt + completion tokens of the chat and small requests that completed, per wall
second), engine crashes (seen as /health refusing), client-visible errors among the requests a lane
could run (chat + small), the router's retries (its smg_worker_retries_total), lane ejections (its
breaker's closed -> open transitions), small requests served after the burst.

    .venv/bin/python bench/fleet.py [--router smg|sglang-router] [--lanes 2] [--quick]

Both routers with the sidecar's defaults since issue 26, every routing policy, 2 and 4 lanes:
``bench/fleet_routers.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.policy.schema import load_policy_file  # noqa: E402
from sidecar_emulator import fleet as F  # noqa: E402

SPEED = 20.0
UNFIT_TOKENS = 300_000

SETUPS: list[tuple[str, str | None, list[str]]] = [
    # (label, sidecar answers: None = no sidecars / "default" / "before" (#26), router flags)
    ("router alone", None, []),
    ("router --max-concurrent-requests 4", None, ["--max-concurrent-requests", "4"]),
    ("sidecars (default answers), router defaults", "default", []),
    ("sidecars (answers before #26: 503), router defaults", "before", []),
    ("sidecars (default answers), recommended flags", "default", F.RECOMMENDED_ROUTER_FLAGS),
    ("sidecars (answers before #26: 503), recommended flags", "before", F.RECOMMENDED_ROUTER_FLAGS),
]


async def chat_load(url: str, n: int, concurrency: int, seed: int) -> list[tuple[F.Answer, int]]:
    rng = random.Random(seed)
    sizes = [rng.randint(1_000, 40_000) for _ in range(n)]
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def one(tokens: int) -> tuple[F.Answer, int]:
            async with gate:
                return await F.send(s, url, tokens, "chat", max_new=32), tokens

        return list(await asyncio.gather(*(one(t) for t in sizes)))


async def run_setup(
    label: str, answers: str | None, flags: list[str], lanes: int, quick: bool, kind: F.RouterKind
) -> dict[str, Any]:
    policy = load_policy_file(ROOT / "sidecar_emulator" / "policies" / "maxq-qwen3next-old.yaml")
    with tempfile.TemporaryDirectory() as d:
        async with F.fleet(Path(d)) as f:
            sidecars = (
                None if answers is None else {answers: None if answers == "default" else F.ANSWERS_BEFORE_26}
            )
            engines, sets = await F.lanes(f, lanes, "maxq-old", policy, SPEED, sidecars=sidecars)
            workers = [e.url for e in engines] if answers is None else [s.url for s in sets[answers]]
            router = await f.router("router", workers, flags, kind=kind)
            await F.wait_ready(router, "/health")
            t0 = time.monotonic()
            async with F.CrashWatch(engines) as watch:
                n_chat = 20 if quick else 60
                burst = asyncio.create_task(
                    F.burst_then_small(router.url, unfit_tokens=UNFIT_TOKENS, n_small=0)
                )
                chat = await chat_load(router.url, n_chat, 6, seed=7)
                unfit = await burst
                small = await F.burst_then_small(router.url, unfit_tokens=UNFIT_TOKENS, n_unfit=0)
            wall = time.monotonic() - t0
            retries = await F.router_retries(router)
            opens = F.breaker_opens(router)
    runnable = [a for a, _ in chat] + small
    served = sum(t + 32 for a, t in chat if a.status == 200) + sum(100 + 8 for a in small if a.status == 200)
    return {
        "setup": label,
        "lanes": lanes,
        "goodput_tokens_per_s": round(served / wall),
        "crashes": sum(watch.crashes.values()),
        "client_errors": sum(1 for a in runnable if a.status != 200),
        "runnable_requests": len(runnable),
        "router_retries": retries,
        "lane_ejections": opens,
        "small_served": sum(1 for a in small if a.status == 200),
        "small_sent": len(small),
        "unfit_statuses": F.summarize(unfit)["unfit_statuses"],
        "wall_s": round(wall, 1),
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| setup | goodput (tok/s) | crashes | client-visible errors | router retries | lane ejections | small served after the burst | unfit answered |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        unfit = ", ".join(f"{k}x{v}" for k, v in r["unfit_statuses"].items())
        out.append(
            f"| {r['setup']} | {r['goodput_tokens_per_s']:,} | {r['crashes']} | "
            f"{r['client_errors']}/{r['runnable_requests']} | {r['router_retries']} | {r['lane_ejections']} | "
            f"{r['small_served']}/{r['small_sent']} | {unfit} |"
        )
    return "\n".join(out)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="20 chat requests instead of 60")
    ap.add_argument("--router", choices=sorted(F.ROUTER_KINDS), default="sglang-router", help="which router")
    args = ap.parse_args()
    rows = []
    for label, answers, flags in SETUPS:
        row = await run_setup(label, answers, flags, args.lanes, args.quick, F.ROUTER_KINDS[args.router])
        print(json.dumps(row), flush=True)
        rows.append(row)
    text = table(rows)
    print(text)
    out = ROOT / "bench" / "results"
    name = "fleet" if args.router == "sglang-router" else f"fleet-{args.router}"
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / f"{name}.md").write_text(
        f"# Lanes behind SGLang's router ({F.ROUTER_KINDS[args.router].name})\n\n`.venv/bin/python "
        f"bench/fleet.py --router {args.router} --lanes {args.lanes}{' --quick' if args.quick else ''}` on a "
        f"2-core machine; {args.lanes} emulated "
        f"maxq-old lanes at --speed {SPEED:g}; 16 x {UNFIT_TOKENS:,}-token requests no lane can run (8 at a "
        "time) during a chat load of 1K-40K-token requests (6 at a time), then 10 small requests. "
        "Recommended flags: `" + " ".join(F.RECOMMENDED_ROUTER_FLAGS) + "`; answers before #26: "
        "unfit and busy both 503 (`sidecar_emulator.fleet.ANSWERS_BEFORE_26`); default answers: 413 unfit, 429 busy.\n\n"
        + text
        + "\n"
    )
    print(f"wrote {out / name}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
