"""calibrate against real CUDA allocations: ``emulate --cuda`` on one GPU, the real command on NVML.

Starts the emulator as a process (``--cuda``: the profile's pools and transients are real
``torch.empty`` blocks under PyTorch's caching allocator, the card filled to the profile's idle free
memory), runs ``sglang-sidecar calibrate --gpu-source nvml`` against it, and compares the fit with the
profile's true coefficients, term by term, and the fitted projection with the true peak over a grid of
prompt lengths (the worst under-prediction). ``--empty-cache-interval 1`` runs the engine as SGLang
with ``--sleep-on-idle`` and ``SGLANG_EMPTY_CACHE_INTERVAL=1`` (calibrate then reads each multi-chunk
probe as its last chunk over its cached prefix). Once per allocator setting (default and
``expandable_segments:True``), each in a fresh emulator process. Without ``--cuda`` it runs the same
on the modeled device (``--gpu-file``), to test the script on a machine without a GPU:

    PYTHONPATH=. python3 bench/calibrate_cuda.py [--cuda] [--profile h200-qwen3next] [--speed 20]

Writes ``calibrate-cuda-<profile>.json`` to $OUT when set, else ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.calibrate.fit import Coefficients, Probe  # noqa: E402
from sidecar_emulator.probe_lane import true_coefficients  # noqa: E402
from sidecar_emulator.profiles import get_profile  # noqa: E402

POLICY = {
    "maxq-old": "policies/maxq-qwen3next-old.yaml",
    "h200-qwen3next": "policies/h200-generic.yaml",
    "maxq-bounded": "policies/maxq-qwen3next-bounded.yaml",
}
TERMS = tuple(f.name for f in fields(Coefficients))  # every term the fit reports, in its order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"emulator exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("emulator never became ready")


def one_run(args: argparse.Namespace, alloc_conf: str | None, work: Path) -> dict[str, object]:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    gpu_file = work / "gpu.json"
    emu = [
        sys.executable,
        "-m",
        "sidecar",
        "emulate",
        "--profile",
        args.profile,
        "--listen",
        f"127.0.0.1:{port}",
        "--speed",
        str(args.speed),
        "--gpu-file",
        str(gpu_file),
    ]
    if args.cuda:
        emu.append("--cuda")
    interval = float(getattr(args, "empty_cache_interval", 0.0) or 0.0)
    if interval > 0:  # SGLang --sleep-on-idle with SGLANG_EMPTY_CACHE_INTERVAL: calibrate reads last chunks
        emu += ["--empty-cache-interval", str(interval)]
    log = open(work / f"emulate-{alloc_conf or 'default'}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(emu, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    out_json = work / "run.json"
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        source = "nvml" if args.cuda else f"file:{gpu_file}"
        cmd = [
            sys.executable,
            "-m",
            "sidecar",
            "calibrate",
            "--upstream",
            f"http://127.0.0.1:{port}",
            "--gpu-source",
            source,
            "--policy",
            str(ROOT / POLICY[args.profile]),
            "--out",
            str(work / "proposed.yaml"),
            "--json",
            str(out_json),
            "--max-duration-s",
            str(args.budget_s),
        ]
        t0 = time.monotonic()
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.budget_s + 120
        )
        elapsed = time.monotonic() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    result: dict[str, object] = {
        "alloc_conf": alloc_conf or "default",
        "rc": done.returncode,
        "report": done.stdout,
        "stderr": done.stderr[-2000:],
        "wall_s": round(elapsed, 1),
    }
    if out_json.exists():
        data = json.loads(out_json.read_text())
        result["run"] = data
        if "cost" in data:
            result["comparison"] = compare(args.profile, data["cost"])
    return result


def compare(profile_name: str, cost: dict[str, object]) -> dict[str, object]:
    """Fitted against true, per term, and the fitted projection (margin included) against the true
    peak over prompt lengths up to the calibrated range: the worst under-prediction."""
    p = get_profile(profile_name)
    truth = true_coefficients(p)
    fitted = Coefficients(
        float(cost["fixed_bytes"]),
        float(cost["activation_bytes_per_chunk_token"]),
        float(cost["context_bytes_per_token"]),
        float(cost["chunk_context_bytes"]),
        float(cost["gather_bytes_per_context_token"]),
        None if cost.get("gather_cap_bytes") is None else float(cost["gather_cap_bytes"]),
        float(cost["batch_join_bytes"]),
        float(cost["batch_join_bytes_per_running_request"]),
    )
    margin = float(cost["margin"])
    terms = {t: {"true": getattr(truth, t), "fitted": getattr(fitted, t)} for t in TERMS}
    chunk = p.chunked_prefill_size
    worst = (float("inf"), 0)
    top = int(cost["calibrated_up_to_prompt_tokens"])
    for n in range(chunk // 16, top + 1, chunk // 16):
        probe = Probe("grid", n)
        true_peak = truth.probe_peak(probe, chunk)
        ratio = fitted.probe_peak(probe, chunk) * margin / true_peak if true_peak else float("inf")
        worst = min(worst, (ratio, n))
    return {
        "terms": terms,
        "margin": margin,
        "worst_projection_over_true": round(worst[0], 4),
        "worst_at_prompt_tokens": worst[1],
        "calibrated_up_to_prompt_tokens": top,
    }


def facts(cuda: bool) -> dict[str, object]:
    out: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if cuda:
        import pynvml
        import torch

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out.update(
            gpu=pynvml.nvmlDeviceGetName(h),
            driver=pynvml.nvmlSystemGetDriverVersion(),
            torch=torch.__version__,
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--profile", default="h200-qwen3next", choices=sorted(POLICY))
    ap.add_argument("--speed", type=float, default=20.0)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument(
        "--empty-cache-interval",
        type=float,
        default=0.0,
        help="the engine empties its allocator cache after idling this long (SGLANG_EMPTY_CACHE_INTERVAL)",
    )
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    results = {"facts": facts(args.cuda), "profile": args.profile, "cuda": args.cuda, "runs": []}
    for conf in (None, "expandable_segments:True") if args.cuda else (None,):
        with tempfile.TemporaryDirectory() as tmp:
            r = one_run(args, conf, Path(tmp))
        results["runs"].append(r)  # type: ignore[attr-defined]
        print(
            f"== {r['alloc_conf']}: rc {r['rc']} in {r['wall_s']} s\n{r['report']}{r['stderr']}", flush=True
        )
        if "comparison" in r:
            print(json.dumps(r["comparison"], indent=1), flush=True)
    (out_dir / f"calibrate-cuda-{args.profile}.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
