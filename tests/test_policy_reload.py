"""One source of truth for the running policy: an upload goes into the policy file, so SIGHUP keeps it;
every attempt from either path is logged, recorded in /admission/state and counted."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sidecar.app import SidecarApp
from sidecar.policy.schema import load_policy_file
from tests.conftest import ROOT, small_policy
from tests.harness import (
    FAST,
    FakeEngine,
    SidecarUrl,
    eventually,
    serve,
    serve_argv,
    serve_both,
    wait_serving,
)

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def policy_yaml(name: str) -> str:
    data = json.loads(small_policy(**FAST).policy.model_dump_json())
    return yaml.safe_dump(data | {"name": name}, sort_keys=False)


def reloads(metrics_text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "sglang_sidecar_policy_reloads":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["result"]] = s.value
    return out


def file_lane(engine_url: str, policy_file: Path) -> SidecarApp:
    """A sidecar whose policy comes from ``policy_file`` (uploads are written back to it)."""
    return SidecarApp(
        upstream=engine_url,
        policy=load_policy_file(policy_file),
        policy_path=str(policy_file),
        gpu_source=None,
        admin_token=TOKEN,
    )


async def test_an_upload_is_written_to_the_file_so_sighup_keeps_it(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="sidecar")
    policy_file = tmp_path / "lane.yaml"
    policy_file.write_text(policy_yaml("from-file"))
    async with serve(FakeEngine()) as engine_url:
        app = file_lane(engine_url, policy_file)
        async with serve_both(app) as url, httpx.AsyncClient(timeout=10) as client:
            text = policy_yaml("uploaded")
            r = await client.post(url.admin + "/admission/policy", content=text, headers=AUTH)
            assert r.status_code == 200 and r.json()["name"] == "uploaded", r.text
            assert policy_file.read_text() == text  # the file is the policy
            assert not [p for p in tmp_path.iterdir() if p.name.endswith(".upload")]

            # The next SIGHUP (a config-management run, say) re-reads the file: the upload stays.
            os.kill(os.getpid(), signal.SIGHUP)
            await eventually(lambda: app.policy_source.last_reload.via == "sighup")
            state = (await client.get(url.admin + "/admission/state")).json()["policy"]
            assert state["name"] == "uploaded" and state["sha256"] == r.json()["sha256"]
            assert state["last_reload"]["via"] == "sighup" and state["last_reload"]["result"] == "applied"
            assert state["last_failure"] is None

            # A broken file: refused, logged, recorded as the last failure, counted.
            policy_file.write_text("name: broken\nnot_a_field: 1\n")
            os.kill(os.getpid(), signal.SIGHUP)
            await eventually(lambda: app.policy_source.last_failure is not None)
            state = (await client.get(url.admin + "/admission/state")).json()["policy"]
            assert state["name"] == "uploaded"
            failure = state["last_failure"]
            assert failure["via"] == "sighup" and failure["result"] == "refused"
            assert "not_a_field" in failure["error"]
            counted = reloads((await client.get(url.admin + "/metrics")).text)
            assert counted == {"applied": 2.0, "refused": 1.0}
    messages = [r.getMessage() for r in caplog.records if r.name == "sidecar.policy.schema"]
    assert any("via upload: applied uploaded" in m for m in messages)
    assert any("via sighup: applied uploaded" in m for m in messages)
    assert any("via sighup: refused, keeping uploaded" in m and "not_a_field" in m for m in messages)


async def test_refused_uploads_and_bad_tokens_are_logged_and_change_nothing(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="sidecar")
    policy_file = tmp_path / "lane.yaml"
    original = policy_yaml("from-file")
    policy_file.write_text(original)
    async with serve(FakeEngine()) as engine_url:
        app = file_lane(engine_url, policy_file)
        async with serve_both(app) as url, httpx.AsyncClient(timeout=10) as client:
            no_auth = await client.post(url.admin + "/admission/policy", content=policy_yaml("x"))
            assert no_auth.status_code == 401
            bad = await client.post(
                url.admin + "/admission/policy", content="name: x\nbogus: 1\n", headers=AUTH
            )
            assert bad.status_code == 422 and bad.json()["kept"] == "from-file"
            binary = await client.post(url.admin + "/admission/policy", content=b"\xff\xfe", headers=AUTH)
            assert binary.status_code == 422 and "UTF-8" in binary.json()["error"]["message"]
            assert policy_file.read_text() == original and app.admission.policy.name == "from-file"
            state = (await client.get(url.admin + "/admission/state")).json()["policy"]
            assert state["last_failure"]["via"] == "upload"
    messages = [r.getMessage() for r in caplog.records if r.name == "sidecar.policy.schema"]
    assert any("refused (401)" in m and "127.0.0.1" in m for m in messages)
    assert any("via upload: refused" in m and "bogus" in m for m in messages)


# --------------------------------------------------------------------------------------------------
# A read-only policy file (a ConfigMap mount): the upload is refused with 409. The directory is made
# read-only for real; as root that takes a process without CAP_DAC_OVERRIDE, so the sidecar runs as its
# own process under setpriv.
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def readonly_lane() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sidecar-ro-"))
    (d / "lane.yaml").write_text(policy_yaml("from-configmap").replace("required: true", "required: false"))
    (d / "token").write_text(TOKEN)
    d.chmod(0o555)
    try:
        yield d
    finally:
        d.chmod(0o755)
        shutil.rmtree(d)


def without_privileges() -> list[str]:
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop root's permission override"
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner"]


async def test_an_upload_to_a_read_only_policy_file_is_refused_with_409(readonly_lane: Path) -> None:
    policy_file = readonly_lane / "lane.yaml"
    original = policy_file.read_text()
    port, admin_port = free_port(), free_port()
    async with serve(FakeEngine()) as engine_url:
        proc = subprocess.Popen(
            [
                *without_privileges(),
                *serve_argv(
                    engine_url,
                    policy_file,
                    port,
                    admin_port,
                    "--admin-token-file",
                    str(readonly_lane / "token"),
                ),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        url = SidecarUrl(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}")
        try:
            await wait_serving(proc, url + "/healthz")
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(
                    url.admin + "/admission/policy", content=policy_yaml("uploaded"), headers=AUTH
                )
                assert r.status_code == 409, r.text
                assert r.json()["error"]["code"] == "policy_file_read_only"
                assert "SIGHUP" in r.json()["error"]["message"] and r.json()["kept"] == "from-configmap"
                state = (await client.get(url.admin + "/admission/state")).json()["policy"]
                assert state["name"] == "from-configmap"
                assert (
                    state["last_failure"]["via"] == "upload"
                    and "cannot be written" in state["last_failure"]["error"]
                )
                assert reloads((await client.get(url.admin + "/metrics")).text)["refused"] == 1.0
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
    assert policy_file.read_text() == original
    assert "via upload: refused, keeping from-configmap" in err


def configmap_mount(root: Path, text: str, version: int) -> None:
    """Lay out a Kubernetes ConfigMap volume as the kubelet does (and swap it the same way):
    ``policy.yaml -> ..data/policy.yaml``, ``..data -> ..<version>``, the new version written beside the
    old one and ``..data`` replaced by a rename of a fresh symlink."""
    version_dir = root / f"..2026_12_06_{version:02d}"
    version_dir.mkdir()
    (version_dir / "policy.yaml").write_text(text)
    tmp_link = root / "..data_tmp"
    tmp_link.symlink_to(version_dir.name)
    os.replace(tmp_link, root / "..data")
    if not (root / "policy.yaml").is_symlink():
        (root / "policy.yaml").symlink_to("..data/policy.yaml")


async def test_the_watched_policy_file_applies_on_change_without_a_signal(tmp_path: Path) -> None:
    """The mounted policy changes (a ConfigMap's symlink swap, then an edit in place): each valid
    change is applied within the watch interval, an invalid one is refused once and the running policy
    stays, and an upload that writes the file is not applied twice."""
    mount = tmp_path / "policy"
    mount.mkdir()
    configmap_mount(mount, policy_yaml("v1"), 1)
    policy_file = mount / "policy.yaml"
    async with serve(FakeEngine()) as engine_url:
        app = SidecarApp(
            upstream=engine_url,
            policy=load_policy_file(policy_file),
            policy_path=str(policy_file),
            gpu_source=None,
            policy_watch_s=0.05,
        )
        async with serve_both(app) as url, httpx.AsyncClient(timeout=10) as client:

            async def state() -> dict:
                return (await client.get(url.admin + "/admission/state")).json()["policy"]

            def recorded(name: str) -> bool:  # applied, and the attempt recorded (after the swap)
                rec = app.policy_source.last_reload
                return rec is not None and rec.result == "applied" and rec.policy == name

            configmap_mount(mount, policy_yaml("v2"), 2)  # the kubelet's swap of ..data
            await eventually(lambda: recorded("v2"))
            assert app.admission.loaded.policy.name == "v2"
            assert (await state())["last_reload"]["via"] == "file_change"

            configmap_mount(mount, "name: [broken\n", 3)
            await eventually(lambda: app.policy_source.last_failure is not None)
            assert app.admission.loaded.policy.name == "v2"  # refused: the running one stays

            async def counted(want: dict[str, float]) -> bool:  # counted after it is recorded
                return reloads((await client.get(url.admin + "/metrics")).text) == want

            await eventually(lambda: counted({"applied": 1.0, "refused": 1.0}))

            # Edited in place (not through the symlink's target directory): seen by mtime and size.
            (mount / "..2026_12_06_03" / "policy.yaml").write_text(policy_yaml("v3-edited"))
            await eventually(lambda: recorded("v3-edited"))
            assert app.admission.loaded.policy.name == "v3-edited"
            await eventually(lambda: counted({"applied": 2.0, "refused": 1.0}))


def test_an_unchanged_or_rewritten_identical_file_reloads_nothing(tmp_path: Path) -> None:
    """The content decides: a change of identity that leaves the policy as it is (an upload written
    back, `touch`) applies nothing, so an upload is not applied a second time by the watch."""
    from sidecar.policy.source import PolicySource

    policy_file = tmp_path / "lane.yaml"
    policy_file.write_text(policy_yaml("same"))
    loaded = [load_policy_file(policy_file)]
    applied: list[str] = []
    src = PolicySource(
        str(policy_file), lambda lp: (applied.append(lp.policy.name), loaded.append(lp)), lambda: loaded[-1]
    )
    assert src.reload_if_changed() is None  # first look: the file says what is in force
    os.utime(policy_file, ns=(1, 1))
    policy_file.write_text(policy_yaml("same"))
    assert src.reload_if_changed() is None and applied == []
    policy_file.write_text(policy_yaml("other"))
    rec = src.reload_if_changed()
    assert rec is not None and rec.via == "file_change" and applied == ["other"]
    assert src.reload_if_changed() is None  # nothing changed since
