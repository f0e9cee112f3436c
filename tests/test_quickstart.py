"""The README's quick start, pasted as a newcomer would: the emulator block runs and answers.

Only the fixed ports and the GPU file's path are swapped for free ones (tests never take fixed ports);
every command is the README's own text.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def emulator_block() -> str:
    start = README.index("Without a GPU, try it against the bundled engine emulator:")
    m = re.search(r"```bash\n(.*?)```", README[start:], re.S)
    assert m, "the quick start's emulator block is gone"
    return m.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_quick_start_emulator_block_works_as_pasted(tmp_path: Path) -> None:
    block = emulator_block()
    assert "sglang-sidecar wait" in block  # it waits for readiness before it queries
    engine, side, admin = free_port(), free_port(), free_port()
    script = (
        block.replace("30000", str(engine))
        .replace("localhost:8001", f"localhost:{side}")
        .replace("127.0.0.1:8001", f"127.0.0.1:{side}")
        .replace("localhost:8002", f"localhost:{admin}")
        .replace("/tmp/gpu.json", str(tmp_path / "gpu.json"))
    )
    # The README relies on serve's default --listen; give it the free port the same way a user would
    # set it in the environment.
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "SIDECAR_LISTEN": f"127.0.0.1:{side}",
        "SIDECAR_ADMIN_LISTEN": f"127.0.0.1:{admin}",
    }
    # Files, not pipes: the background servers keep their stdout open after the script ends.
    out_file, err_file = tmp_path / "stdout", tmp_path / "stderr"
    with out_file.open("w") as out_f, err_file.open("w") as err_f:
        proc = subprocess.Popen(
            ["bash", "-e", "-c", script],
            cwd=ROOT,
            env=env,
            stdout=out_f,
            stderr=err_f,
            text=True,
            start_new_session=True,  # its background servers are in this group, and only they
        )
        try:
            proc.wait(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    out, err = out_file.read_text(), err_file.read_text()
    assert proc.returncode == 0, err[-3000:]
    assert "ready" in out
    documents = [json.loads(d) for d in re.findall(r"^\{.*?^\}", out, re.S | re.M)]
    state, explain = documents
    assert state["mode"] == "enforce" and state["engine"]["age_s"] is not None
    assert state["gpu"]["free_bytes"] is not None and state["policy"]["name"] == "maxq-qwen3next-old"
    # The outage lane cannot run a 500K prefill at all: the policy summary says so, explain agrees.
    assert explain["decision"] == "reject" and explain["reason"] == "unfit_request"
