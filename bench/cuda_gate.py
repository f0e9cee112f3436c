"""The outage on a real GPU: the emulator's pool and transients as CUDA memory, the sidecar on real NVML.

Runs the demo's scenario three times on one GPU: without the gate, with the shipped Max-Q policy
(headroom from the lane's idle budget), and with the same policy judged on live NVML free. Prints a
table and writes JSON (to $OUT when set, else bench/results/). Needs torch with CUDA and nvidia-ml-py:

    PYTHONPATH=. python3 bench/cuda_gate.py [--speed 25]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar.policy.schema import HeadroomSource, load_policy_file
from sidecar_emulator.demo import DEFAULT_SCENARIO, WINDOW_S, run_phase, scale_policy
from sidecar_emulator.replay import format_table
from sidecar_emulator.scenario import load_scenario


def facts() -> dict[str, object]:
    import pynvml
    import torch

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": pynvml.nvmlDeviceGetName(h),
        "uuid": pynvml.nvmlDeviceGetUUID(h),
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "nvml_total_mib": mem.total // 2**20,
        "nvml_free_mib_at_start": mem.free // 2**20,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    scenario = load_scenario(DEFAULT_SCENARIO)
    seed = scenario.seed if args.seed is None else args.seed
    shipped = load_policy_file(scenario.policy_path(DEFAULT_SCENARIO.parent))
    on_nvml = shipped.with_section("vram", headroom=HeadroomSource.NVML_FREE)
    info = facts()
    print(json.dumps(info, indent=1))
    results = {}
    for label, policy in (
        ("no gate", None),
        ("gate: idle budget", shipped),
        ("gate: live NVML free", on_nvml),
    ):
        print(f"\n== {label}")
        scaled = scale_policy(policy, args.speed) if policy else None
        results[label] = asyncio.run(
            run_phase(scenario, scaled, args.speed, seed, label[:8], WINDOW_S, cuda=True)
        )
    print()
    print(format_table(results))
    for label, r in results.items():
        for c in r["crashes"]:
            print(f"{label}: crashed at t={c['t']:.0f}s: {c['reason']}")
        if r["gate"]:
            print(
                f"{label}: gpu source {r['gpu_source']}, last NVML free {r['gpu_free_bytes_last']} B, "
                f"ledger at end {r['ledger_at_end']}"
            )
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out = out_dir / "cuda_gate.json"
    out.write_text(
        json.dumps(
            {"facts": info, "speed": args.speed, "seed": seed, "results": results}, indent=1, default=str
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 1 if any(r["crashes"] for r in results.values() if r["gate"]) else 0


if __name__ == "__main__":
    sys.exit(main())
