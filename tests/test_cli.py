"""The command line as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import EMULATOR_POLICIES, POLICIES, ROOT


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_serve_help_names_every_option_and_its_environment_variable() -> None:
    r = run("serve", "--help")
    assert r.returncode == 0
    for flag, env in [
        ("--upstream", "SIDECAR_UPSTREAM"),
        ("--listen", "SIDECAR_LISTEN"),
        ("--policy", "SIDECAR_POLICY"),
        ("--gpu-source", "SIDECAR_GPU_SOURCE"),
        ("--mode", "SIDECAR_MODE"),
        ("--admin-token-file", "SIDECAR_ADMIN_TOKEN_FILE"),
    ]:
        assert flag in r.stdout and env in r.stdout


def test_check_policy_accepts_every_shipped_policy() -> None:
    for path in sorted([*POLICIES.glob("*.yaml"), *EMULATOR_POLICIES.glob("*.yaml")]):
        r = run("check-policy", str(path))
        assert r.returncode == 0, r.stderr
        assert "OK" in r.stdout


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """`check-policy ... | head -1`: the pipe closes before the summary is written; the command ends
    quietly with a shell's SIGPIPE status instead of printing a BrokenPipeError traceback."""
    p = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "check-policy", str(EMULATOR_POLICIES / "maxq-qwen3next-old.yaml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before the first write: every write fails
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err, err


def test_check_policy_locates_errors(tmp_path: Path) -> None:
    text = (EMULATOR_POLICIES / "maxq-qwen3next-old.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        re.sub(
            r"(?m)^  margin: [0-9.]+", "  margin: 0.5", text.replace("  max_requests: 2", "  max_requets: 2")
        )
    )
    r = run("check-policy", str(bad))
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    line_no = next(i for i, t in enumerate(text.splitlines(), 1) if "max_requests: 2" in t)
    # A typo of a required field is one line, at the typo, naming the field it meant (not two: the
    # typo unknown and the field missing); a bound says what it is and what the file holds.
    assert (
        f"  {bad}:{line_no}: engine_queue.max_requets: unknown field in engine_queue; did you mean 'max_requests'?"
        in lines
    )
    assert not any("engine_queue.max_requests" in x for x in lines), lines
    assert any(x.endswith("cost.margin: must be at least 1, got 0.5") for x in lines), lines


def test_check_policy_on_yaml_garbage_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n  oops: [\n")
    r = run("check-policy", str(bad))
    assert r.returncode == 2 and f"{bad}:2" in r.stderr and "YAML syntax" in r.stderr
    r = run("check-policy", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_serve_refuses_bad_settings_clearly() -> None:
    r = run("serve", "--upstream", "localhost:30000", "--policy", str(POLICIES / "h200-generic.yaml"))
    assert r.returncode == 2 and "upstream" in r.stderr and "http://" in r.stderr
    r = run(
        "serve",
        "--policy",
        str(POLICIES / "h200-generic.yaml"),
        env={"SIDECAR_UPSTREAM": "http://127.0.0.1:1"},
    )
    assert r.returncode == 2 and "no GPU source" in r.stderr  # environment variables are read
    r = run(
        "serve",
        "--upstream",
        "http://127.0.0.1:1",
        "--policy",
        str(POLICIES / "h200-generic.yaml"),
        "--gpu-source",
        "cuda:0",
    )
    assert r.returncode == 2 and "--gpu-source" in r.stderr and "nvml" in r.stderr


def test_serve_fails_at_start_up_when_the_gpu_source_cannot_be_read(tmp_path: Path) -> None:
    r = run(
        "serve",
        "--upstream",
        "http://127.0.0.1:1",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--policy",
        str(POLICIES / "h200-generic.yaml"),
        "--gpu-source",
        f"file:{tmp_path}/no-such-dir/gpu.json",
    )
    assert r.returncode != 0
    assert f"directory {tmp_path}/no-such-dir does not exist" in r.stderr


async def test_serve_moves_what_start_up_built_out_of_the_collector_s_sight(tmp_path: Path) -> None:
    """A full collection walked every object start-up built (~80,000 after the imports) on the event
    loop's thread: the paced benchmark's 120-180 ms stalls on 2 cores. ``serve`` freezes them once it
    listens; the benchmark's probe (the real CLI, wrapped) says how many are frozen and how long the
    collector paused since."""
    import httpx

    from tests.harness import FakeEngine, serve, wait_serving
    from tests.test_logging import free_port, write_policy

    policy = write_policy(tmp_path)
    port = free_port()
    async with serve(FakeEngine(events=1)) as engine_url:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "probed_sidecar.py"), "serve", "--upstream", engine_url,
             "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{free_port()}",
             "--policy", str(policy)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_serving(proc, url + "/readyz")
            async with httpx.AsyncClient(timeout=10) as client:
                lag = (await client.get(url + "/__bench/lag")).json()
        finally:
            proc.kill()
            proc.wait(timeout=30)
    assert lag["gc_frozen"] > 20_000
    # and hands the GIL back to the loop's thread within 1 ms of asking (not CPython's 5 ms)
    assert lag["switch_interval_s"] <= 0.001
