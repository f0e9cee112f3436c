"""The in-flight prefill guard on a real GPU: the emulator's transients as CUDA memory, the sidecar on NVML.

The old Max-Q lane (`sidecar_emulator/policies/maxq-qwen3next-old.yaml`, calibrated on the unperturbed `maxq-old`
profile) serving an engine whose transients run 1.2x its coefficients: one 260,000-token prompt, which
the policy admits at margin 1.051 and whose true peak does not fit the lane, then a 100,000-token one.
Run twice, the guard off and on. Off, the first prompt's last chunks are a real CUDA out-of-memory
error; on, the monitor sees the lane on the first chunks (NVML free, a caching allocator's low-water
mark, against the transient at the progress SGLang's counter shows), raises the margin, and the guard
aborts the prompt before its peak. Prints a table and writes JSON (to $OUT when set, else
bench/results/). Needs torch with CUDA and nvidia-ml-py:

    PYTHONPATH=. python3 bench/guard_cuda.py [--speed 25]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cuda_gate import facts
from sidecar.policy.schema import load_policy_file
from sidecar_emulator import demo
from sidecar_emulator.probe_lane import perturbed
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.replay import format_table
from sidecar_emulator.scenario import Request, Requests, Scenario

ROOT = Path(__file__).resolve().parents[1]
PROFILE = perturbed(get_profile("maxq-old"), scale=1.2)


def scenario() -> Scenario:
    return Scenario(
        name="guard-cuda",
        description="a 260K prompt on the old Max-Q lane whose transients run 1.2x the policy's coefficients",
        profile=PROFILE.name,
        policy="sidecar_emulator/policies/maxq-qwen3next-old.yaml",
        duration_s=180,
        workload=[
            Requests(
                kind="requests",
                requests=[
                    Request(t=0, prompt_tokens=260_000, max_new_tokens=64),
                    Request(t=40, prompt_tokens=100_000, max_new_tokens=64),
                ],
            )
        ],
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed", type=float, default=25.0)
    ap.add_argument("--modeled", action="store_true", help="the modeled device and a GPU file (no CUDA)")
    args = ap.parse_args()
    # run_phase finds the profile by the scenario's name: the perturbed one is not a shipped profile.
    demo.get_profile = lambda name: PROFILE if name == PROFILE.name else get_profile(name)  # type: ignore[assignment]
    policy = load_policy_file(ROOT / "sidecar_emulator/policies/maxq-qwen3next-old.yaml")
    info = {"device": "modeled"} if args.modeled else facts()
    print(json.dumps(info, indent=1))
    results = {}
    for label, enabled in (("guard off", False), ("guard on", True)):
        print(f"\n== {label}")
        scaled = demo.scale_policy(policy.with_section("guard", enabled=enabled), args.speed)
        phase = demo.run_phase(scenario(), scaled, args.speed, 0, label, 120.0, cuda=not args.modeled)
        results[label] = asyncio.run(phase)
    print()
    print(format_table(results))
    for label, r in results.items():
        for c in r["crashes"]:
            print(f"{label}: crashed at t={c['t']:.0f}s: {c['reason']}")
        print(
            f"{label}: outcomes {[q['outcome'] for q in r['requests_detail']]}, ledger at end {r['ledger_at_end']}"
        )
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out = out_dir / "guard_cuda.json"
    out.write_text(
        json.dumps({"facts": info, "speed": args.speed, "results": results}, indent=1, default=str) + "\n"
    )
    print(f"wrote {out}")
    return 1 if results["guard on"]["crashes"] or not results["guard off"]["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
