"""The under-prediction monitor and ``idle_free_bytes: auto`` against real CUDA allocations.

Per variant, a fresh ``emulate --cuda`` (the profile's transients are real ``torch.empty`` blocks under
PyTorch's caching allocator, the card filled to the profile's idle free memory) and the real
``sglang-sidecar serve`` in front of it reading NVML, with the shipped policy for the profile turned to
``idle_free_bytes: auto``: once as calibrated, once with every cost coefficient x0.8 (the same as an
engine 1.25x larger than the policy says). It sends cold prompts of growing length, one at a time, and
records after each what ``/admission/state`` says (idle figure measured, findings, margin in force).
Without ``--cuda`` the same runs on the modeled device through ``--gpu-file``:

    PYTHONPATH=. python3 bench/monitor_cuda.py [--cuda] [--profile h200-qwen3next] [--speed 20]

Writes ``monitor-cuda-<profile>.json`` to $OUT when set, else ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.calibrate_cuda import POLICY, facts, free_port, wait_ready  # noqa: E402

SCALED = (
    "fixed_bytes",
    "activation_bytes_per_chunk_token",
    "context_bytes_per_token",
    "gather_bytes_per_context_token",
    "gather_cap_bytes",
    "batch_join_bytes",
    "batch_join_bytes_per_running_request",
)
PROMPTS = (8_192, 32_768, 65_536, 131_072, 196_608, 262_144)


def policy_text(profile: str, scale: float) -> str:
    data = yaml.safe_load((ROOT / POLICY[profile]).read_text())
    data["vram"]["idle_free_bytes"] = "auto"
    for k in SCALED:
        v = data["cost"].get(k)
        if isinstance(v, int | float) and not isinstance(v, bool):
            data["cost"][k] = int(v * scale)
    data["cost"]["chunk_context_bytes"] = float(data["cost"].get("chunk_context_bytes", 0.0)) * scale
    data["name"] = f"{data['name']}-x{scale:g}"
    return yaml.safe_dump(data, sort_keys=False)


def one_variant(args: argparse.Namespace, scale: float, work: Path) -> dict[str, object]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    eport, sport = free_port(), free_port()
    gpu_file = work / "gpu.json"
    emu = [sys.executable, "-m", "sidecar", "emulate", "--profile", args.profile]
    emu += ["--listen", f"127.0.0.1:{eport}", "--speed", str(args.speed), "--gpu-file", str(gpu_file)]
    if args.cuda:
        emu.append("--cuda")
    pol = work / "policy.yaml"
    pol.write_text(policy_text(args.profile, scale))
    sidecar = [sys.executable, "-m", "sidecar", "serve", "--upstream", f"http://127.0.0.1:{eport}"]
    sidecar += ["--listen", f"127.0.0.1:{sport}", "--policy", str(pol), "--trust-emulator-sizes"]
    sidecar += ["--gpu-source", "nvml" if args.cuda else f"file:{gpu_file}", "--log-format", "json"]
    elog = open(work / "emulate.log", "wb")  # noqa: SIM115
    slog = open(work / "sidecar.log", "wb")  # noqa: SIM115
    procs = [subprocess.Popen(emu, cwd=ROOT, env=env, stdout=elog, stderr=subprocess.STDOUT)]
    steps: list[dict[str, object]] = []
    try:
        wait_ready(f"http://127.0.0.1:{eport}", procs[0])
        procs.append(subprocess.Popen(sidecar, cwd=ROOT, env=env, stdout=slog, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{sport}"
        wait_ready(url, procs[1])
        with httpx.Client(timeout=300) as client:
            deadline = time.monotonic() + 30
            while client.get(url + "/admission/state").json()["idle_free"]["measured_bytes"] is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("idle free memory never measured")
                time.sleep(0.2)
            for i, n in enumerate(PROMPTS):
                body = {"text": "x", "rid": f"p{i}-{n}", "sampling_params": {"max_new_tokens": 4}}
                body["emulator"] = {"prompt_tokens": n}
                r = client.post(url + "/generate", json=body)
                time.sleep(0.5)  # two GPU polls after the answer: the reading of its peak is in
                s = client.get(url + "/admission/state").json()
                steps.append(
                    {
                        "prompt_tokens": n,
                        "status": r.status_code,
                        "reason": r.headers.get("x-admission-reason"),
                        "idle_free_bytes": s["idle_free"]["measured_bytes"],
                        "underestimates": s["monitor"]["underestimates"],
                        "worst_ratio": s["monitor"]["worst_ratio"],
                        "margin": s["monitor"]["margin"]["effective"],
                        "last": s["monitor"]["last"],
                    }
                )
                print(json.dumps(steps[-1]), flush=True)
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        elog.close()
        slog.close()
    return {
        "scale": scale,
        "steps": steps,
        "sidecar_log_tail": (work / "sidecar.log").read_text()[-3000:],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--profile", default="h200-qwen3next", choices=sorted(POLICY))
    ap.add_argument("--speed", type=float, default=20.0)
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    results: dict[str, object] = {"facts": facts(args.cuda), "profile": args.profile, "cuda": args.cuda}
    runs = []
    for scale in (1.0, 0.8):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"== coefficients x{scale:g}", flush=True)
            runs.append(one_variant(args, scale, Path(tmp)))
    results["runs"] = runs
    (out_dir / f"monitor-cuda-{args.profile}.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
