"""The outage on a real GPU: the emulator's pool and transients as CUDA memory, the sidecar on real NVML.

Runs the demo's scenario three times on one GPU: without the gate, with the shipped Max-Q policy
(headroom from the lane's idle budget), and with the same policy judged on live NVML free. Prints a
table and writes JSON (to $OUT when set, else bench/results/). Needs torch with CUDA and nvidia-ml-py:

    PYTHONPATH=. python3 bench/cuda_gate.py [--speed 25]

``--tp 2`` (issue 28; needs two GPUs): the TP2 scenario (``scenarios/tp/tp2-neighbour.yaml``), one
engine rank per card (rank i on CUDA device i), the sidecar on NVML for both cards by UUID, and the
scenario's neighbour as a real process allocating on GPU 1. Three runs: no gate; gated per GPU (the
scenario's policy, its other-process allowance set to what NVML shows at idle on this machine); and
the lane's budget taken as the sum of both cards, which should crash as the ungated run does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar.policy.schema import HeadroomSource, load_policy_file
from sidecar_emulator.demo import DEFAULT_SCENARIO, WINDOW_S, run_phase, scale_policy
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.replay import format_table
from sidecar_emulator.scenario import GpuEvent, load_scenario


def facts(index: int = 0) -> dict[str, object]:
    import pynvml
    import torch

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
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


# A real neighbour: another process holding ``nbytes`` on one card until it is stopped.
NEIGHBOUR = """
import sys, time, torch
held = torch.empty(int(sys.argv[2]), dtype=torch.uint8, device=f"cuda:{sys.argv[1]}")
print("ready", flush=True)
while True:
    time.sleep(60)
"""


class Neighbours:
    """One neighbour process per GPU, replaced at each of the scenario's GPU events (growth over the
    profile's idle neighbour, which the TorchDevice ballast already stands for)."""

    def __init__(self, idle_bytes: int) -> None:
        self.idle_bytes = idle_bytes
        self.procs: dict[int, subprocess.Popen[str]] = {}

    def __call__(self, ev: GpuEvent) -> None:
        gpu = ev.gpu or 0
        self.stop(gpu)
        grow = int(ev.other_process_bytes) - self.idle_bytes
        if grow > 0:
            p = subprocess.Popen(
                [sys.executable, "-c", NEIGHBOUR, str(gpu), str(grow)], stdout=subprocess.PIPE, text=True
            )
            assert p.stdout is not None
            p.stdout.readline()  # allocated: NVML shows it from now on
            self.procs[gpu] = p

    def stop(self, gpu: int | None = None) -> None:
        for g in [g for g in self.procs if gpu is None or g == gpu]:
            p = self.procs.pop(g)
            p.terminate()
            p.wait(timeout=30)


def main_tp(args: argparse.Namespace) -> int:
    import pynvml
    import torch

    if args.tp != 2:
        print("--tp: only 2 is scripted (scenarios/tp/tp2-neighbour.yaml)", file=sys.stderr)
        return 2
    if torch.cuda.device_count() < 2:
        print(f"--tp 2 needs two GPUs; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    path = Path(__file__).resolve().parents[1] / "scenarios" / "tp" / "tp2-neighbour.yaml"
    scenario = load_scenario(path)
    seed = scenario.seed if args.seed is None else args.seed
    profile = get_profile(scenario.profile)
    info = {"gpus": [facts(i) for i in range(2)]}
    print(json.dumps(info, indent=1))
    uuids = ",".join(str(g["uuid"]) for g in info["gpus"])  # type: ignore[index]
    pynvml.nvmlInit()
    policy = load_policy_file(scenario.policy_path(path.parent))
    # On this machine nothing else holds memory on the cards at idle: NVML's other-process figure is 0
    # (the profile's idle neighbour is part of the ballast, which is this process's own memory).
    per_gpu = policy.with_section("vram", other_processes_bytes=0)
    v = per_gpu.policy.vram
    summed = per_gpu.with_section("vram", idle_free_bytes=2 * (v.idle_free_bytes or 0))
    results = {}
    for label, pol in (("no gate", None), ("gate: per GPU", per_gpu), ("gate: summed budget", summed)):
        print(f"\n== {label}")
        neighbours = Neighbours(profile.other_process_bytes)
        try:
            results[label] = asyncio.run(
                run_phase(
                    scenario,
                    scale_policy(pol, args.speed) if pol else None,
                    args.speed,
                    seed,
                    label[:8],
                    WINDOW_S,
                    cuda=True,
                    gpu_source=f"nvml:{uuids}",
                    on_gpu_event=neighbours,
                )
            )
        finally:
            neighbours.stop()
    print()
    print(format_table(results))
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out = out_dir / "cuda_gate_tp2.json"
    out.write_text(
        json.dumps(
            {"facts": info, "speed": args.speed, "seed": seed, "results": results}, indent=1, default=str
        )
        + "\n"
    )
    print(f"wrote {out}")
    expected = bool(results["no gate"]["crashes"]) and not results["gate: per GPU"]["crashes"]
    return 0 if expected else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks (2: the TP2 scenario on two GPUs)"
    )
    args = ap.parse_args()
    if args.tp > 1:
        return main_tp(args)
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
