"""An oracle on the real card: calibrate's proposal against the best zero-OOM margin/reserve setting.

On one GPU, with one PyTorch allocator setting (``--alloc-conf``, set before CUDA starts):

1. ``emulate --cuda`` of the lane's profile in a process of its own (its pools and every transient
   are real ``torch.empty`` blocks, the card scaled to the profile's idle free memory), and the real
   ``sglang-sidecar calibrate --gpu-source nvml`` against it, starting from the lane's policy: the
   proposal is what an operator would install.
2. The core scenarios of that lane, live (``emulate --cuda`` + the sidecar on real NVML, as
   ``bench/cuda_gate.py``), under the proposal, then under a sweep of margins and reserves applied to
   the emulator-exact cost terms (the profile's true coefficients). Real CUDA out-of-memory errors are
   counted; the oracle is the sweep's best goodput with none.

Prints a table and writes ``oracle-cuda-<profile>-<alloc>.json`` (to $OUT when set, else
bench/results/). Without ``--cuda`` the same runs on the modeled device (a test on a machine without a
GPU). Needs torch with CUDA and nvidia-ml-py for ``--cuda``:

    PYTHONPATH=. python3 bench/oracle_cuda.py --cuda [--alloc-conf expandable_segments:True]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
# The lanes and their core scenarios (the scenarios the shipped emulator policies are judged on).
LANES = {
    "maxq-old": ["scenarios/maxq-outage-burst.yaml"],
    "maxq-bounded": ["scenarios/paired-250k-cold.yaml", "scenarios/noisy-neighbour.yaml"],
}
MARGINS = (1.0, 1.1, 1.25, 1.5)
RESERVES_MIB = (2, 64, 256)


def calibrate_on_card(args: argparse.Namespace, work: Path) -> tuple[Path | None, dict[str, object]]:
    """The real calibrate command against ``emulate --cuda`` in its own process: the proposal's path."""
    from bench import calibrate_cuda

    ns = argparse.Namespace(
        cuda=args.cuda,
        profile=args.profile,
        speed=args.calibrate_speed,
        budget_s=args.budget_s,
        empty_cache_interval=args.empty_cache_interval,
    )
    result = calibrate_cuda.one_run(ns, args.alloc_conf, work)
    proposed = work / "proposed.yaml"
    return (proposed if proposed.exists() else None), result


def exact_policy(scenario_path: Path, loaded):  # type: ignore[no-untyped-def]
    """``loaded`` (the proposal, so that only the cost terms, the margin and the reserve differ) with
    the profile's true coefficients: what the engine model allocates."""
    from sidecar_emulator.probe_lane import true_coefficients
    from sidecar_emulator.profiles import get_profile
    from sidecar_emulator.scenario import load_scenario

    sc = load_scenario(scenario_path)
    t = true_coefficients(get_profile(sc.profile))
    return loaded.with_section(
        "cost",
        fixed_bytes=0,
        activation_bytes_per_chunk_token=int(t.activation_bytes_per_chunk_token),
        context_bytes_per_token=int(t.context_bytes_per_token),
        chunk_context_bytes=0.0,
        gather_bytes_per_context_token=int(t.gather_bytes_per_context_token),
        gather_cap_bytes=None if t.gather_cap_bytes is None else int(t.gather_cap_bytes),
        batch_join_bytes=int(t.batch_join_bytes or 0),
        batch_join_bytes_per_running_request=0,
        calibrated_ratio=1.0,
    )


def one(scenario_path: Path, policy, args: argparse.Namespace, label: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    from sidecar_emulator.demo import run_phase, scale_policy
    from sidecar_emulator.scenario import load_scenario

    sc = load_scenario(scenario_path)
    t0 = time.monotonic()
    r = asyncio.run(
        run_phase(
            sc,
            scale_policy(policy, args.speed),
            args.speed,
            sc.seed,
            label[:8],
            args.window_s,
            cuda=args.cuda,
        )
    )
    return {
        "label": label,
        "crashes": len(r["crashes"]),
        "crash_reasons": [c["reason"][:160] for c in r["crashes"]],
        "completed": r["completed"],
        "rejected": r["rejected"],
        "rejected_by_reason": r["rejected_by_reason"],
        "failed": r["failed"],
        "served_tokens": r["served_tokens"],
        "goodput_tokens_per_s": r["goodput_tokens_per_s"],
        "wall_s": round(time.monotonic() - t0, 1),
    }


def facts(cuda: bool, alloc_conf: str | None) -> dict[str, object]:
    out: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "alloc_conf": alloc_conf or "default",
    }
    if cuda:
        from bench.cuda_gate import facts as card_facts

        out.update(card_facts())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--profile", default="maxq-old", choices=sorted(LANES))
    ap.add_argument(
        "--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF for both the engine and calibrate"
    )
    ap.add_argument("--speed", type=float, default=25.0)
    ap.add_argument("--calibrate-speed", type=float, default=20.0)
    ap.add_argument("--budget-s", type=float, default=100.0, help="calibrate's time budget")
    ap.add_argument("--window-s", type=float, default=300.0, help="engine seconds each scenario runs")
    ap.add_argument("--margins", default=",".join(str(m) for m in MARGINS))
    ap.add_argument("--reserves-mib", default=",".join(str(r) for r in RESERVES_MIB))
    ap.add_argument(
        "--empty-cache-interval",
        type=float,
        default=0.0,
        help="while calibrating, the engine empties its allocator cache after idling this long "
        "(SGLang --sleep-on-idle with SGLANG_EMPTY_CACHE_INTERVAL); 0: never, as before",
    )
    args = ap.parse_args()
    if args.alloc_conf == "default":
        args.alloc_conf = None  # PyTorch's own default: the variable unset (torch aborts on "default")
    if args.alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = (
            args.alloc_conf
        )  # before torch starts CUDA, here and in children
    from sidecar.policy.schema import load_policy_file

    info = facts(args.cuda, args.alloc_conf)
    print(json.dumps(info, indent=1), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        proposed, cal = calibrate_on_card(args, Path(tmp))
        print(
            f"== calibrate ({info['alloc_conf']}): rc {cal['rc']}\n{cal['report']}{cal['stderr'][-600:]}",
            flush=True,
        )
        proposal = load_policy_file(proposed) if proposed else None
        proposal_text = proposed.read_text() if proposed else None
    info["empty_cache_interval_s"] = args.empty_cache_interval
    results: dict[str, object] = {
        "facts": info,
        "profile": args.profile,
        "calibrate": cal,
        "proposal": proposal_text,
    }
    scenarios: dict[str, object] = {}
    for rel in LANES[args.profile]:
        path = ROOT / rel
        rows = []
        if proposal is not None:
            rows.append(one(path, proposal, args, "calibrate's proposal"))
        from bench.calibrate_cuda import POLICY

        exact = exact_policy(path, proposal or load_policy_file(ROOT / POLICY[args.profile]))
        for m in (float(x) for x in args.margins.split(",")):
            for r in (int(x) for x in args.reserves_mib.split(",")):
                variant = exact.with_section("cost", margin=m).with_section("vram", reserve_bytes=r * MiB)
                rows.append(one(path, variant, args, f"exact x{m:g} +{r} MiB"))
                print(json.dumps(rows[-1]), flush=True)
        scenarios[path.stem] = summarise(rows)
    results["scenarios"] = scenarios
    print_table(scenarios)
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    alloc = "expandable" if args.alloc_conf and "expandable_segments:True" in args.alloc_conf else "default"
    out = out_dir / f"oracle-cuda-{args.profile}-{alloc}.json"
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


def summarise(rows: list[dict[str, object]]) -> dict[str, object]:
    """The best zero-OOM row of the sweep, and the proposal against it."""
    sweep = [r for r in rows if r["label"] != "calibrate's proposal"]
    safe = [r for r in sweep if r["crashes"] == 0]
    best = max(safe, key=lambda r: float(r["goodput_tokens_per_s"]), default=None)  # type: ignore[arg-type]
    prop = next((r for r in rows if r["label"] == "calibrate's proposal"), None)
    share = None
    if best and prop and float(best["goodput_tokens_per_s"]) > 0:  # type: ignore[arg-type]
        share = round(float(prop["goodput_tokens_per_s"]) / float(best["goodput_tokens_per_s"]), 4)  # type: ignore[arg-type]
    return {"rows": rows, "best_zero_oom": best["label"] if best else None, "proposal_share_of_best": share}


def print_table(scenarios: dict[str, object]) -> None:
    for name, s in scenarios.items():
        print(f"\n{name}: best zero-OOM {s['best_zero_oom']}, proposal {s['proposal_share_of_best']} of it")  # type: ignore[index]
        print(f"  {'setting':24} {'OOMs':>4} {'done':>5} {'rejected':>8} {'goodput tok/s':>14}")
        for r in s["rows"]:  # type: ignore[index]
            print(
                f"  {r['label']:24} {r['crashes']:>4} {r['completed']:>5} {r['rejected']:>8} "
                f"{r['goodput_tokens_per_s']:>14,.0f}"
            )


if __name__ == "__main__":
    sys.exit(main())
