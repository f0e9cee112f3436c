"""Start-up failures a person can act on: said once, by the sidecar's own logger in --log-format (a
JSON collector gets one more object, ``event=startup_failed``), with the exit status `--help` documents:
2 for what was written wrong, 3 for what could not be started."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.conftest import ROOT

POLICY = ROOT / "policies" / "h200-generic.yaml"


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            "--log-format",
            "json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def lines(stderr: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        assert line.startswith("{"), f"not JSON: {line}"  # every line in the chosen format
        out.append(json.loads(line))
    return out


def errors(stderr: str) -> list[dict]:
    return [x for x in lines(stderr) if x["level"] == "error"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_taken_port_names_itself_and_exits_3(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = serve(
            "--policy", str(POLICY), "--gpu-source", f"file:{tmp_path / 'gpu.json'}",
            "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{free_port()}",
        )  # fmt: skip
    assert r.returncode == 3, r.stderr
    (said,) = errors(r.stderr)
    assert said["logger"] == "sidecar" and said["event"] == "startup_failed" and said["exit_code"] == 3
    assert (
        said["message"].startswith(f"cannot listen on 127.0.0.1:{port}: ")
        and f"sport = :{port}" in said["message"]
    )


def test_an_unreadable_gpu_source_is_one_line_of_ours_and_exits_3() -> None:
    r = serve(
        "--policy", str(POLICY), "--gpu-source", f"dcgm:http://127.0.0.1:{free_port()}/metrics",
        "--listen", f"127.0.0.1:{free_port()}", "--admin-listen", f"127.0.0.1:{free_port()}",
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    (said,) = errors(r.stderr)  # not also uvicorn's "Application startup failed. Exiting."
    assert said["logger"] == "sidecar" and said["event"] == "startup_failed"
    assert "dcgm-exporter" in said["message"]
    assert not [x for x in lines(r.stderr) if "Application startup failed" in x["message"]]


def test_an_invalid_policy_is_logged_in_the_chosen_format_and_exits_2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "lane.yaml"
    bad.write_text(POLICY.read_text().replace("  margin:", "  margn:", 1))
    r = serve("--policy", str(bad), "--gpu-source", "nvml")
    assert r.returncode == 2
    (said,) = errors(r.stderr)
    assert said["event"] == "startup_failed" and said["exit_code"] == 2
    assert "cost.margn: unknown field in cost; did you mean 'margin'?" in said["message"]


def test_help_documents_the_exit_statuses() -> None:
    for argv in ([], ["serve"]):
        out = subprocess.run(
            [sys.executable, "-m", "sidecar", *argv, "--help"], capture_output=True, text=True, check=True
        ).stdout
        flat = " ".join(out.split())
        assert "xit status: 0 " in flat and " 2 " in flat and " 3 " in flat, flat[-800:]
    assert (
        "141"
        in subprocess.run(
            [sys.executable, "-m", "sidecar", "--help"], capture_output=True, text=True, check=True
        ).stdout
    )


def test_invalid_settings_name_the_flag_and_variable_in_the_chosen_format() -> None:
    r = serve("--policy", str(POLICY), "--drain-timeout-s", "-1", "--upstream", "localhost:30000")
    assert r.returncode == 2
    (said,) = errors(r.stderr)
    assert said["event"] == "startup_failed"
    assert "--drain-timeout-s [SIDECAR_DRAIN_TIMEOUT_S]: must be at least 0, got -1" in said["message"]
    assert "--upstream [SIDECAR_UPSTREAM]: upstream must be an http:// or https:// URL" in said["message"]
    assert not any(w in said["message"] for w in ("Value error", "Input should"))


def test_a_corrupt_state_file_names_the_file_and_field_and_exits_2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Starting from the policy alone would forget the margin a crash raised or an unconfirmed build."""
    state = tmp_path / "lane.json"
    state.write_text('{"version": 1, "conservative": true}')
    r = serve(
        "--policy", str(POLICY), "--gpu-source", f"file:{tmp_path / 'gpu.json'}", "--state-file", str(state),
        "--listen", f"127.0.0.1:{free_port()}", "--admin-listen", f"127.0.0.1:{free_port()}",
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    (said,) = errors(r.stderr)
    assert said["event"] == "startup_failed" and said["exit_code"] == 2
    assert f"{state}: conservative: Input should be a valid string" in said["message"]
    assert f"{state}: cost_fingerprint: Field required" in said["message"]
