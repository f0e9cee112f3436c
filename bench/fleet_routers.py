"""Behind both of SGLang's real routers, on real processes: what each does with the sidecar's answers.

Routers: ``smg`` 1.13.0 (the model gateway's PyPI package) and ``sglang-router`` 0.3.2 (PyPI's last
release of the older one), both pinned in the test extra. Lanes: 2 or 4 emulated Max-Q lanes
(``sglang-sidecar emulate --speed 20``), a sidecar in front of each. The lanes are started once per
lane count and router; each case gets a fresh router (its breakers closed, its counters at zero).

Cases (``CASES``):

- the acceptance matrix: the sidecar at its defaults (unfit 413, busy 429, engine gone 503); smg at its
  defaults, 0.3.2 with the documented flags (``fleet.RECOMMENDED_ROUTER_FLAGS``); every routing policy
  the router has; 16 and 32 requests no lane can run (300K tokens, compact ``input_ids``: 0.86 MiB, under
  smg's 1 MiB retry cut), 8 at a time, then 10 small requests one after another;
- the baselines that say why: the answers before issue 26 (unfit and busy 503) behind smg at its
  defaults, and the new defaults behind 0.3.2 at its defaults (round robin);
- the mixed load, ``--repeats`` times each (a distribution, not one draw): the burst during a chat load
  (1K-40K tokens, 6 at a time), then 10 small requests; behind smg with its overload veto on (the
  default: a lane whose ``/v1/loads`` shows 8 waiting, held requests included, leaves the rotation) and
  off, and behind 0.3.2 with the documented flags.

Bounded: every request has a 120 s client timeout; each case stops by itself. Writes
``bench/results/fleet-routers.{json,md}``; ``tests/test_fleet_replay.py`` replays every case below
(``LIVE``) and compares ejections and small requests served.

    .venv/bin/python bench/fleet_routers.py [--quick] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fleet import chat_load  # noqa: E402
from sidecar.policy.schema import load_policy_file  # noqa: E402
from sidecar_emulator import fleet as F  # noqa: E402

SPEED = 20.0
UNFIT_TOKENS = 300_000
VETO_OFF = ["--disable-worker-overload-protection"]


def router_setups() -> list[tuple[F.RouterKind, str, list[str]]]:
    """(router, its settings' label, flags): smg at its defaults; 0.3.2 with the documented flags."""
    return [(F.SMG, "defaults", []), (F.SGLANG_ROUTER, "documented flags", F.RECOMMENDED_ROUTER_FLAGS)]


def health_out(router: F.Proc, answers: list[F.Answer]) -> bool:
    """Lanes out of the rotation with no breaker opened: the router's own "no available workers" with
    its breaker closed (or off) means its health check took them out (the sidecar's /readyz failing:
    its signals' age past the policy's max, 0.25 s at --speed 20, on a starved machine)."""
    return F.breaker_opens(router) == 0 and any(a.code == "no_available_workers" for a in answers)


async def burst_case(
    f: F.Fleet, workers: list[str], kind: F.RouterKind, flags: list[str], policy: str, n_unfit: int
) -> dict[str, Any]:
    router = await f.router("router", workers, flags, kind=kind, policy=policy)
    await F.wait_ready(router, "/health")
    t0 = time.monotonic()
    answers = await F.burst_then_small(router.url, unfit_tokens=UNFIT_TOKENS, n_unfit=n_unfit)
    wall = time.monotonic() - t0
    row = {
        "ejections": F.breaker_opens(router),
        "router_retries": await F.router_retries(router),
        "wall_s": round(wall, 1),
        "health_out": health_out(router, answers),
        **F.summarize(answers),
    }
    await f.stop(router)
    return row


async def mixed_case(
    f: F.Fleet, workers: list[str], kind: F.RouterKind, flags: list[str], policy: str, seed: int
) -> dict[str, Any]:
    router = await f.router("router", workers, flags, kind=kind, policy=policy)
    await F.wait_ready(router, "/health")
    t0 = time.monotonic()
    burst = asyncio.create_task(F.burst_then_small(router.url, unfit_tokens=UNFIT_TOKENS, n_small=0))
    chat = await chat_load(router.url, 40, 6, seed=seed)
    unfit = await burst
    small = await F.burst_then_small(router.url, unfit_tokens=UNFIT_TOKENS, n_unfit=0)
    wall = time.monotonic() - t0
    row = {
        "ejections": F.breaker_opens(router),
        "router_retries": await F.router_retries(router),
        "wall_s": round(wall, 1),
        "chat_served": sum(1 for a, _ in chat if a.status == 200),
        "chat_sent": len(chat),
        "chat_statuses": dict(Counter(str(a.status) for a, _ in chat)),
        "health_out": health_out(router, [a for a, _ in chat] + unfit + small),
        **F.summarize(unfit + small),
    }
    await f.stop(router)
    return row


def holds(sidecars: list[F.Proc]) -> int:
    """Hold decisions in the sidecars' decision logs so far (each request held at least once)."""
    n = 0
    for s in sidecars:
        path = s.log.with_name(s.name + ".decisions.jsonl")
        if path.exists():
            n += sum(
                1 for line in path.read_text().splitlines() if '"decision":"hold"' in line.replace(" ", "")
            )
    return n


async def held_case(
    f: F.Fleet, sidecars: list[F.Proc], flags: list[str], policy: str, seed: int
) -> dict[str, Any]:
    """Enough long prompts at once that the sidecars hold many (32 at a time, 40K-80K tokens): does
    counting the held in /v1/loads (smg's overload veto at 8 waiting) help or hurt?"""
    workers = [s.url for s in sidecars]
    held_before = holds(sidecars)
    router = await f.router("router", workers, flags, kind=F.SMG, policy=policy)
    await F.wait_ready(router, "/health")
    t0 = time.monotonic()
    rng = random.Random(seed)
    sizes = [rng.randint(40_000, 80_000) for _ in range(64)]
    gate = asyncio.Semaphore(32)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def one(tokens: int) -> F.Answer:
            async with gate:
                return await F.send(s, router.url, tokens, "chat", max_new=32)

        chat = list(await asyncio.gather(*(one(t) for t in sizes)))
    wall = time.monotonic() - t0
    row = {
        "ejections": F.breaker_opens(router),
        "router_retries": await F.router_retries(router),
        "wall_s": round(wall, 1),
        "held": holds(sidecars) - held_before,
        "served": sum(1 for a in chat if a.status == 200),
        "sent": len(chat),
        "statuses": dict(Counter(str(a.status) for a in chat)),
        "p50_s": round(sorted(a.seconds for a in chat)[len(chat) // 2], 2),
    }
    await f.stop(router)
    return row


async def held_run(repeats: int) -> list[dict[str, Any]]:
    policy_file = load_policy_file(ROOT / "policies" / "maxq-qwen3next-old.yaml")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        async with F.fleet(Path(d)) as f:
            _, sets = await F.lanes(f, 2, "maxq-old", policy_file, SPEED, sidecars={"default": None})
            for pol in ("round_robin", "least_load"):
                for label, flags in (("overload veto on (default)", []), ("overload veto off", VETO_OFF)):
                    for k in range(repeats):
                        r = await held_case(f, sets["default"], flags, pol, seed=11 + k)
                        row = {
                            "router": F.SMG.name,
                            "lanes": 2,
                            "policy": pol,
                            "settings": label,
                            "repeat": k,
                        } | r
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    return rows


def held_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| policy | settings | run | holds | served | answers | ejections | retries | p50 s | wall s |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        answers = ", ".join(f"{k}x{v}" for k, v in r["statuses"].items())
        out.append(
            f"| {r['policy']} | {r['settings']} | {r['repeat']} | {r['held']} | {r['served']}/{r['sent']} | {answers} | "
            f"{r['ejections']} | {r['router_retries']} | {r['p50_s']} | {r['wall_s']} |"
        )
    return "\n".join(out)


async def lanes_run(
    lanes: int, kind: F.RouterKind, flags: list[str], label: str, quick: bool, repeats: int
) -> list[dict[str, Any]]:
    """Every case on one set of lanes: the matrix for this router, its baseline, its mixed loads."""
    policy_file = load_policy_file(ROOT / "policies" / "maxq-qwen3next-old.yaml")
    rows: list[dict[str, Any]] = []
    policies = kind.policies[:2] if quick else kind.policies
    with tempfile.TemporaryDirectory() as d:
        async with F.fleet(Path(d)) as f:
            engines, sets = await F.lanes(
                f,
                lanes,
                "maxq-old",
                policy_file,
                SPEED,
                sidecars={"default": None, "old": F.ANSWERS_BEFORE_26},
            )
            new, old = [s.url for s in sets["default"]], [s.url for s in sets["old"]]
            base = {"router": kind.name, "lanes": lanes}

            def emit(row: dict[str, Any]) -> None:
                print(json.dumps(row), flush=True)
                rows.append(row)

            async with F.CrashWatch(engines) as watch:
                for n_unfit in (16, 32):
                    for pol in policies:
                        r = await burst_case(f, new, kind, flags, pol, n_unfit)
                        emit(
                            base
                            | {"case": "burst", "answers": "defaults", "settings": label}
                            | r
                            | {"policy": pol, "n_unfit": n_unfit}
                        )
                    # Why: the other side's settings, round robin.
                    if kind is F.SMG:
                        r = await burst_case(f, old, kind, [], "round_robin", n_unfit)
                        emit(
                            base
                            | {"case": "burst", "answers": "before #26 (503)", "settings": "defaults"}
                            | r
                            | {"policy": "round_robin", "n_unfit": n_unfit}
                        )
                    else:
                        r = await burst_case(f, new, kind, [], "round_robin", n_unfit)
                        emit(
                            base
                            | {"case": "burst", "answers": "defaults", "settings": "defaults"}
                            | r
                            | {"policy": "round_robin", "n_unfit": n_unfit}
                        )
                if lanes == 2:
                    mixes = [(label, flags)]
                    if kind is F.SMG:
                        mixes.append(("defaults, overload veto off", VETO_OFF))
                    for mix_label, mix_flags in mixes:
                        for k in range(1 if quick else repeats):
                            r = await mixed_case(f, new, kind, mix_flags, "round_robin", seed=7 + k)
                            emit(
                                base
                                | {"case": "mixed", "answers": "defaults", "settings": mix_label}
                                | r
                                | {"policy": "round_robin", "n_unfit": 16, "repeat": k}
                            )
            crashes = sum(watch.crashes.values())
    for r in rows:
        r["crashes_during_lane_set"] = crashes
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| draw | router | settings | sidecar answers | lanes | policy | unfit | ejections | health out "
        "| small served | retries | unfit answered | wall s |",
        "|---:|---|---|---|---:|---|---:|---:|---|---:|---:|---|---:|",
    ]
    for r in rows:
        if r["case"] != "burst":
            continue
        unfit = ", ".join(f"{k}x{v}" for k, v in r["unfit_statuses"].items())
        out.append(
            f"| {r.get('draw', 1)} | {r['router']} | {r['settings']} | {r['answers']} | {r['lanes']} | "
            f"{r['policy']} | {r['n_unfit']} | {r['ejections']} | {'yes' if r.get('health_out') else '-'} | "
            f"{r['small_served']}/{r['small_sent']} | "
            f"{r['router_retries']} | {unfit} | {r['wall_s']} |"
        )
    return "\n".join(out)


def mixed_table(rows: list[dict[str, Any]]) -> str:
    """One line per router and settings: how many of N runs ejected a lane, chat and small served."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["case"] == "mixed":
            groups.setdefault((r["router"], r["settings"]), []).append(r)
    out = [
        "| router | settings | runs | runs with a lane ejected | runs with lanes out by health check "
        "| chat served (each run) | small served (each run) | retries (each run) |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for (router, settings), rs in groups.items():
        ejected = sum(1 for r in rs if r["ejections"] > 0)
        health = sum(1 for r in rs if r.get("health_out"))
        chat = ", ".join(f"{r['chat_served']}/{r['chat_sent']}" for r in rs)
        small = ", ".join(f"{r['small_served']}/{r['small_sent']}" for r in rs)
        retries = ", ".join(str(r["router_retries"]) for r in rs)
        out.append(
            f"| {router} | {settings} | {len(rs)} | {ejected} of {len(rs)} | {health} of {len(rs)} | {chat} "
            f"| {small} | {retries} |"
        )
    return "\n".join(out)


def old_runs(out: Path) -> list[str]:
    path = out / "fleet-routers.runs.json"
    return json.loads(path.read_text()) if path.exists() else []


def write_report(out: Path, rows: list[dict[str, Any]], runs: list[str]) -> None:
    """``fleet-routers.md`` from every draw's rows, and the list of the runs that made them."""
    (out / "fleet-routers.runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    md = (
        "# The sidecar behind both SGLang routers (smg 1.13.0, sglang-router 0.3.2)\n\n"
        "Runs, on a 2-core machine shared with other work (each a new draw; earlier draws kept):\n\n"
        + "".join(f"- {r}\n" for r in runs)
        + f"\nEmulated maxq-old lanes at --speed {SPEED:g}, a sidecar in front of each; {UNFIT_TOKENS:,}-token "
        "requests no lane can run (compact input_ids, 0.86 MiB: under smg's 1 MiB retry cut), 8 at a time, "
        "then 10 small requests. Sidecar defaults: unfit 413, busy 429 + Retry-After, engine gone 503. "
        "0.3.2's documented flags: `"
        + " ".join(F.RECOMMENDED_ROUTER_FLAGS)
        + "`. Ejections: the router's breaker transitions closed -> open (its own log). Health out: lanes "
        "left the rotation with no breaker open (the router's own no_available_workers): its health check "
        "on the sidecar's /readyz, which fails when the signals are older than the policy's max age (0.25 s "
        "at --speed 20), as on a starved machine.\n\n"
        "## Bursts\n\n"
        + table(rows)
        + "\n\n## Mixed load (burst during 40 chat requests, 2 lanes, round robin)\n\n"
        + mixed_table(rows)
        + "\n"
    )
    (out / "fleet-routers.md").write_text(md)
    print(md)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two policies, one mixed run, 2 lanes only")
    ap.add_argument("--repeats", type=int, default=3, help="mixed-load runs per setting (default 3)")
    ap.add_argument("--held", action="store_true", help="only the held-load experiment (veto on / off)")
    ap.add_argument("--only", choices=["smg", "sglang-router"], help="one router only")
    ap.add_argument("--lanes", type=int, choices=[2, 4], help="one lane count only")
    ap.add_argument("--append", action="store_true", help="add this run's rows as a new draw to the results")
    ap.add_argument("--report", action="store_true", help="only rewrite fleet-routers.md from the JSON")
    args = ap.parse_args()
    started = time.monotonic()
    out = ROOT / "bench" / "results"
    if args.held:
        rows = await held_run(args.repeats)
        (out / "fleet-routers-held.json").write_text(json.dumps(rows, indent=1) + "\n")
        md = (
            "# Held requests and smg's overload veto\n\n"
            f"`.venv/bin/python bench/fleet_routers.py --held --repeats {args.repeats}` on a 2-core shared "
            f"machine, {(time.monotonic() - started) / 60:.0f} min: 2 emulated maxq-old lanes (--speed "
            f"{SPEED:g}), a sidecar in front of each (its defaults: held requests counted in /v1/loads' "
            "num_waiting_reqs), smg 1.13.0; 64 requests of 40K-80K tokens, 32 at a time (holds: the sidecars' hold decisions). Veto on: smg's "
            "default (a lane at 8 waiting or KV usage 0.8 leaves the rotation while the other is under); off: "
            "`--disable-worker-overload-protection`.\n\n" + held_table(rows) + "\n"
        )
        (out / "fleet-routers-held.md").write_text(md)
        print(md)
        return 0
    if args.report:
        write_report(out, json.loads((out / "fleet-routers.json").read_text()), old_runs(out))
        return 0
    old: list[dict[str, Any]] = []
    if args.append:
        old = json.loads((out / "fleet-routers.json").read_text())
    draw = 1 + max((r.get("draw", 1) for r in old), default=0)
    rows: list[dict[str, Any]] = []
    for lanes in [args.lanes] if args.lanes else (2,) if args.quick else (2, 4):
        for kind, label, flags in router_setups():
            if args.only is None or F.ROUTER_KINDS[args.only] is kind:
                rows += await lanes_run(lanes, kind, flags, label, args.quick, args.repeats)
    took = time.monotonic() - started
    rows = old + [r | {"draw": draw} for r in rows]
    (out / "fleet-routers.json").write_text(json.dumps(rows, indent=1) + "\n")
    this = f"`.venv/bin/python bench/fleet_routers.py {' '.join(sys.argv[1:])}`: draw {draw}, {took / 60:.0f} min"
    runs = [*old_runs(out), this]
    write_report(out, rows, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
