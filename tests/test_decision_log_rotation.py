"""The decision log rotates without losing a line: logrotate's rename + SIGUSR1, and size roll-over.

A real ``serve`` process under concurrent load: its file is renamed away and the process signalled
mid-run, while ``--decision-log-max-bytes`` rolls the file over every ~60 lines. Every decision the
process counted (``decisions_total``; each request here is admitted at once) is one line in exactly
one of the files.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
from pathlib import Path

import httpx

from tests.conftest import ROOT
from tests.harness import FakeEngine, eventually, gen, serve
from tests.test_logging import counter, sidecar, write_policy
from tests.tools import run_tool

REQUESTS = 400


def logged(tmp_path: Path) -> list[str]:
    """Every decision line in every file the decision log was ever written to."""
    out: list[str] = []
    for f in sorted(tmp_path.glob("decisions.jsonl*")):
        out += [ln for ln in f.read_text().splitlines() if ln.strip()]
    return out


async def test_rename_and_sigusr1_under_load_and_size_rollover_lose_no_line(tmp_path: Path) -> None:
    policy = write_policy(tmp_path)
    path = tmp_path / "decisions.jsonl"
    args = ("--decision-log", str(path), "--decision-log-max-bytes", "60000", "--decision-log-backups", "100")
    async with (
        serve(FakeEngine(events=1)) as engine_url,
        sidecar(engine_url, policy, *args) as (url, proc),
        httpx.AsyncClient(timeout=20) as client,
    ):

        async def decided() -> float:
            m = (await client.get(url.admin + "/metrics")).text
            return counter(m, "sglang_sidecar_decisions_total")

        sent = iter(range(REQUESTS))

        async def worker() -> None:
            for i in sent:
                r = await client.post(url + "/generate", json=gen(stream=False, rid=f"rot-{i}"))
                assert r.status_code == 200, r.text

        workers = [asyncio.create_task(worker()) for _ in range(16)]
        # Mid-load: logrotate's `create` step renames the file, its postrotate sends SIGUSR1.
        await eventually(lambda: len(logged(tmp_path)) >= 100, timeout=30)
        path.rename(tmp_path / "decisions.jsonl-20261206")
        os.kill(proc.pid, signal.SIGUSR1)
        await eventually(path.exists, timeout=30)  # reopened at the configured path by the next batch
        await asyncio.gather(*workers)
        total = await decided()
        assert total == REQUESTS
        await eventually(lambda: len(logged(tmp_path)) >= total, timeout=30)

    lines = logged(tmp_path)
    rids = [json.loads(ln)["request_id"] for ln in lines]
    assert len(lines) == REQUESTS and sorted(rids) == sorted(f"rot-{i}" for i in range(REQUESTS))
    files = sorted(p.name for p in tmp_path.glob("decisions.jsonl*"))
    assert "decisions.jsonl-20261206" in files and "decisions.jsonl.1" in files, files
    for f in tmp_path.glob("decisions.jsonl*"):
        assert f.stat().st_size <= 60000 or f.name.endswith("20261206"), (f.name, f.stat().st_size)
        # Whole lines only: a batch never straddles two files.
        assert f.read_text().endswith("\n")


SNIPPET = ROOT / "deploy/logrotate/sglang-sidecar"


def test_the_snippet_rotates_the_units_decision_log() -> None:
    """The path is the systemd unit's, and the signal is the reopen one (SIGHUP would reload the policy)."""
    text = SNIPPET.read_text()
    env = (ROOT / "deploy/systemd/sglang-sidecar.env").read_text()
    [log_path] = [ln.split("=", 1)[1] for ln in env.splitlines() if ln.startswith("SIDECAR_DECISION_LOG=")]
    assert f"{log_path} {{" in text
    assert "--signal=USR1" in text and "HUP" not in text.replace("SIGHUP would", "")


async def test_real_logrotate_with_the_shipped_snippet_loses_no_line(tmp_path: Path) -> None:
    """logrotate itself runs the snippet (paths and the unit's kill pointed at this test's process)
    twice under load: every decision is in the live file or a rotated one, compressed or not."""
    policy = write_policy(tmp_path)
    path = tmp_path / "decisions.jsonl"
    async with (
        serve(FakeEngine(events=1)) as engine_url,
        sidecar(engine_url, policy, "--decision-log", str(path)) as (url, proc),
        httpx.AsyncClient(timeout=20) as client,
    ):
        conf = tmp_path / "logrotate.conf"
        conf.write_text(
            SNIPPET.read_text()
            .replace("/var/log/sglang-sidecar/decisions.jsonl", str(path))
            .replace(
                "systemctl kill --kill-whom=main --signal=USR1 sglang-sidecar.service",
                f"kill -USR1 {proc.pid}",
            )
        )
        conf.chmod(0o644)
        sent = iter(range(REQUESTS))

        async def worker() -> None:
            for i in sent:
                r = await client.post(url + "/generate", json=gen(stream=False, rid=f"lr-{i}"))
                assert r.status_code == 200, r.text

        workers = [asyncio.create_task(worker()) for _ in range(16)]
        for n in (100, 250):
            await eventually(lambda n=n: len(all_lines(tmp_path)) >= n, timeout=30)
            r = await asyncio.to_thread(
                run_tool, "logrotate", "-f", "-s", str(tmp_path / "logrotate.state"), str(conf)
            )
            assert r.returncode == 0, r.stderr
            await eventually(path.exists, timeout=30)
        await asyncio.gather(*workers)
        await eventually(lambda: len(all_lines(tmp_path)) >= REQUESTS, timeout=30)
    rids = sorted(json.loads(ln)["request_id"] for ln in all_lines(tmp_path))
    assert rids == sorted(f"lr-{i}" for i in range(REQUESTS))
    assert (tmp_path / "decisions.jsonl.1").exists() and (tmp_path / "decisions.jsonl.2.gz").exists()


def all_lines(tmp_path: Path) -> list[str]:
    """Lines of the live file and every rotated one (``.N`` or ``.N.gz``)."""
    out: list[str] = []
    for f in tmp_path.glob("decisions.jsonl*"):
        data = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
        out += [ln for ln in data.decode().splitlines() if ln.strip()]
    return out
