"""GPU sources: file, dcgm-exporter, NVML (fake module, plus one real-GPU test), and the poller."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pynvml  # nvidia-ml-py; importing it needs no driver, only nvmlInit does
import pytest

from sidecar.core.snapshot import DeviceMemory, GpuSignals, SourceHealth
from sidecar.signals.engine import make_control_client
from sidecar.signals.gpu import (
    MIB,
    DcgmSource,
    FileSource,
    GpuPoller,
    GpuSourceError,
    NvmlSource,
    check,
    parse_dcgm,
    parse_gpu_source,
)

GIB = 1024**3

# --------------------------------------------------------------------------------------------------
# Spec strings
# --------------------------------------------------------------------------------------------------

NOT_YET = "does not exist (yet?): GPU signals are stale until its writer creates it"


def test_specs_build_the_named_sources() -> None:
    assert isinstance(parse_gpu_source("nvml"), NvmlSource)
    nv = parse_gpu_source("nvml:GPU-aaa, GPU-bbb")
    assert isinstance(nv, NvmlSource) and nv.uuids == ("GPU-aaa", "GPU-bbb")
    dcgm = parse_gpu_source("dcgm:http://dcgm.test:9400/metrics#GPU-aaa")
    assert isinstance(dcgm, DcgmSource)
    assert (dcgm.url, dcgm.uuids) == ("http://dcgm.test:9400/metrics", ("GPU-aaa",))
    assert dcgm.spec == "dcgm:http://dcgm.test:9400/metrics#GPU-aaa"
    f = parse_gpu_source("file:/run/gpu.json")
    assert isinstance(f, FileSource) and f.path == Path("/run/gpu.json")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", "unknown GPU source"),
        ("gpu0", "unknown GPU source"),
        ("NVML", "unknown GPU source"),
        ("nvml:", "empty UUID"),
        ("nvml:GPU-a,,GPU-b", "empty UUID"),
        ("dcgm:", "dcgm-exporter"),
        ("dcgm:localhost:9400/metrics", "dcgm-exporter"),
        ("dcgm:ftp://x/metrics", "dcgm-exporter"),
        ("dcgm:http://x:9400/metrics#", "empty UUID"),
        ("file:", "needs a path"),
        ("file", "unknown GPU source"),
    ],
)
def test_bad_specs_are_value_errors_naming_the_accepted_forms(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_gpu_source(spec)
    assert "dcgm:" in str(info.value) or "file:" in str(info.value)


# --------------------------------------------------------------------------------------------------
# file:
# --------------------------------------------------------------------------------------------------


def write(path: Path, obj: object) -> Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return path


async def test_file_source_single_device_reread_each_poll(tmp_path: Path) -> None:
    path = write(tmp_path / "gpu.json", {"free_bytes": 3 * GIB, "total_bytes": 96 * GIB})
    source = parse_gpu_source(f"file:{path}")
    first = await source.read(5.0)
    assert first.devices == (DeviceMemory(ident=str(path), free_bytes=3 * GIB, total_bytes=96 * GIB),)
    assert first.source == f"file:{path}"
    assert 4.0 < first.observed_at <= 5.0  # just written: as old as the file, i.e. about now
    write(path, {"free_bytes": GIB, "total_bytes": 96 * GIB})
    assert (await source.read(6.0)).free_bytes == GIB


async def test_file_source_is_as_old_as_the_file(tmp_path: Path) -> None:
    """A writer that died must not leave a frozen reading that looks fresh."""
    import os
    import time

    path = write(tmp_path / "gpu.json", {"free_bytes": 3 * GIB, "total_bytes": 96 * GIB})
    old = time.time() - 60
    os.utime(path, (old, old))
    signals = await parse_gpu_source(f"file:{path}").read(1000.0)
    assert 1000.0 - signals.observed_at == pytest.approx(60, abs=5)


async def test_file_source_several_devices_headroom_is_the_minimum(tmp_path: Path) -> None:
    path = write(
        tmp_path / "gpus.json",
        {
            "devices": [
                {"uuid": "GPU-a", "free_bytes": 10 * GIB, "total_bytes": 80 * GIB},
                {"uuid": "GPU-b", "free_bytes": 2 * GIB, "total_bytes": 96 * GIB},
                {"free_bytes": 5 * GIB, "total_bytes": 80 * GIB},
            ]
        },
    )
    signals = await FileSource(path).read(1.0)
    assert [d.ident for d in signals.devices] == ["GPU-a", "GPU-b", f"{path}[2]"]
    assert signals.free_bytes == 2 * GIB
    assert signals.total_bytes == 96 * GIB  # capacity of the device that decides


async def test_file_source_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(GpuSourceError) as info:
        await FileSource(path).read(0.0)
    assert info.value.message == f"file:{path}: {path} {NOT_YET}"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"free_bytes": 1}, "missing field 'total_bytes'"),
        ({"free_bytes": "12", "total_bytes": 20}, "'free_bytes' must be a non-negative integer"),
        ({"free_bytes": -1, "total_bytes": 20}, "'free_bytes' must be a non-negative integer"),
        ({"free_bytes": True, "total_bytes": 20}, "'free_bytes' must be a non-negative integer"),
        ({"free_bytes": 30, "total_bytes": 20}, "free_bytes 30 is larger than total_bytes 20"),
        ({"devices": []}, "'devices' must be a non-empty list"),
        ({"devices": [{"uuid": "GPU-a", "free_bytes": 1}]}, r"devices\[0\]: missing field 'total_bytes'"),
        ({"devices": [{"uuid": 7, "free_bytes": 1, "total_bytes": 2}]}, "'uuid' must be a string"),
    ],
)
async def test_file_source_malformed_names_path_and_field(
    tmp_path: Path, content: object, match: str
) -> None:
    path = write(tmp_path / "gpu.json", content)
    with pytest.raises(GpuSourceError, match=match) as info:
        await FileSource(path).read(0.0)
    assert str(path) in info.value.message


# --------------------------------------------------------------------------------------------------
# dcgm:
# --------------------------------------------------------------------------------------------------

H200_A = "GPU-5f3ad2c1-8e4b-4d0a-9c61-2b7e0f14a9d3"
H200_B = "GPU-0c9e77b2-13f5-4a8e-b0d4-6e2a91c3f815"


def dcgm_labels(gpu: int, uuid: str, bus: str) -> str:
    return (
        f'gpu="{gpu}",UUID="{uuid}",pci_bus_id="{bus}",device="nvidia{gpu}",modelName="NVIDIA H200",'
        'Hostname="gpu-node-7",DCGM_FI_DRIVER_VERSION="580.159.04",container="sglang",'
        'namespace="llm",pod="sglang-qwen3-next-0"'
    )


GPU0 = dcgm_labels(0, H200_A, "00000000:18:00.0")
GPU1 = dcgm_labels(1, H200_B, "00000000:2A:00.0")

# Modelled on dcgm-exporter 4.x output (default-counters.csv, Kubernetes pod attribution on).
DCGM_EXPOSITION = f"""\
# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{{{GPU0}}} 1980
DCGM_FI_DEV_SM_CLOCK{{{GPU1}}} 1980
# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{{{GPU0}}} 54
DCGM_FI_DEV_GPU_TEMP{{{GPU1}}} 51
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{{{GPU0}}} 412.118000
DCGM_FI_DEV_POWER_USAGE{{{GPU1}}} 388.402000
# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).
# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{GPU0}}} 9812264117
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{GPU1}}} 9533120480
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{{{GPU0}}} 97
DCGM_FI_DEV_GPU_UTIL{{{GPU1}}} 96
# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{{{GPU0},err_code="0",err_msg="No Error"}} 0
DCGM_FI_DEV_XID_ERRORS{{{GPU1},err_code="0",err_msg="No Error"}} 0
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{{{GPU0}}} 143000
DCGM_FI_DEV_FB_FREE{{{GPU1}}} 1200
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{{{GPU0}}} 0
DCGM_FI_DEV_FB_USED{{{GPU1}}} 141800
# HELP DCGM_FI_DEV_FB_RESERVED Framebuffer memory reserved (in MiB).
# TYPE DCGM_FI_DEV_FB_RESERVED gauge
DCGM_FI_DEV_FB_RESERVED{{{GPU0}}} 615
DCGM_FI_DEV_FB_RESERVED{{{GPU1}}} 615
# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.
# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge
DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{GPU0}}} 0.962318
DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{GPU1}}} 0.955104
"""

DCGM_URL = "http://dcgm-exporter.gpu-operator.svc:9400/metrics"


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with make_control_client() as c:
        yield c


def test_parse_dcgm_converts_mib_and_adds_reserved_to_total() -> None:
    assert parse_dcgm(DCGM_EXPOSITION) == [
        DeviceMemory(ident=H200_A, free_bytes=143000 * MIB, total_bytes=(143000 + 0 + 615) * MIB),
        DeviceMemory(ident=H200_B, free_bytes=1200 * MIB, total_bytes=(1200 + 141800 + 615) * MIB),
    ]


def test_parse_dcgm_without_reserved_and_without_uuid_label() -> None:
    text = 'DCGM_FI_DEV_FB_FREE{gpu="3"} 7064\nDCGM_FI_DEV_FB_USED{gpu="3"} 1057\n'
    assert parse_dcgm(text) == [DeviceMemory(ident="3", free_bytes=7064 * MIB, total_bytes=8121 * MIB)]


async def test_dcgm_source_reads_all_gpus(respx_mock, client) -> None:
    route = respx_mock.get(DCGM_URL).mock(return_value=httpx.Response(200, text=DCGM_EXPOSITION))
    signals = await parse_gpu_source(f"dcgm:{DCGM_URL}", http_client=client).read(7.0)
    assert signals.observed_at == 7.0 and signals.source == f"dcgm:{DCGM_URL}"
    assert signals.free_bytes == 1200 * MIB
    assert route.calls.last.request.url == DCGM_URL  # the #fragment is never sent


async def test_dcgm_source_filters_by_uuid(respx_mock, client) -> None:
    respx_mock.get(DCGM_URL).mock(return_value=httpx.Response(200, text=DCGM_EXPOSITION))
    signals = await parse_gpu_source(f"dcgm:{DCGM_URL}#{H200_A}", http_client=client).read(7.0)
    assert [d.ident for d in signals.devices] == [H200_A]
    assert signals.free_bytes == 143000 * MIB


async def test_dcgm_unknown_uuid_lists_what_the_exporter_has(respx_mock, client) -> None:
    respx_mock.get(DCGM_URL).mock(return_value=httpx.Response(200, text=DCGM_EXPOSITION))
    with pytest.raises(GpuSourceError) as info:
        await DcgmSource(DCGM_URL, ["GPU-missing"], client=client).read(0.0)
    assert "GPU-missing not exported" in info.value.message
    assert H200_A in info.value.message and H200_B in info.value.message


@pytest.mark.parametrize(
    ("response", "match"),
    [
        (httpx.Response(200, text="up 1\n"), "no DCGM_FI_DEV_FB_FREE/DCGM_FI_DEV_FB_USED series"),
        (
            httpx.Response(200, text='DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-x"} 10\n'),
            "DCGM_FI_DEV_FB_USED missing for GPU GPU-x",
        ),
        (httpx.Response(200, text="<html>nope</html>"), "not Prometheus text"),
        (httpx.Response(503), "503 Service Unavailable"),
    ],
)
async def test_dcgm_errors_are_clear(respx_mock, client, response: httpx.Response, match: str) -> None:
    respx_mock.get(DCGM_URL).mock(return_value=response)
    with pytest.raises(GpuSourceError, match=match):
        await DcgmSource(DCGM_URL, client=client).read(0.0)


async def test_dcgm_unreachable(respx_mock, client) -> None:
    respx_mock.get(DCGM_URL).mock(side_effect=httpx.ConnectError("[Errno -2] Name or service not known"))
    with pytest.raises(GpuSourceError) as info:
        await DcgmSource(DCGM_URL, client=client).read(0.0)
    assert DCGM_URL in info.value.message
    assert "Name or service not known" in info.value.message
    assert "is dcgm-exporter running" in info.value.message


# --------------------------------------------------------------------------------------------------
# nvml: with a fake pynvml module
# --------------------------------------------------------------------------------------------------


class FakeNvml:
    """Just enough of `pynvml` for the source; errors are the real nvidia-ml-py classes."""

    NVMLError = pynvml.NVMLError
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_NoPermission = pynvml.NVMLError_NoPermission
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, gpus: dict[str, tuple[int, int, int]], init_error: Exception | None = None) -> None:
        # uuid -> (total, reserved, used) in bytes; free = total - reserved - used (the v2 identity)
        self.gpus = gpus
        self.init_error = init_error
        self.init_calls = 0
        self.shutdown_calls = 0
        self.lost: set[str] = set()

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return list(self.gpus)[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.gpus:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return uuid

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return handle

    def nvmlDeviceGetMemoryInfo(self, handle: str, version: int | None = None) -> Any:
        if handle in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        total, reserved, used = self.gpus[handle]
        free = total - reserved - used
        if version != pynvml.nvmlMemory_v2:  # v1: `used` silently includes `reserved`
            return SimpleNamespace(total=total, free=free, used=used + reserved)
        return SimpleNamespace(version=version, total=total, reserved=reserved, free=free, used=used)


# Figures measured on an H200 (evidence N1): total 150754820096, reserved 644939776.
H200_TOTAL, H200_RESERVED = 150754820096, 644939776


def two_gpus() -> FakeNvml:
    return FakeNvml(
        {
            "GPU-aaaa": (H200_TOTAL, H200_RESERVED, 11289821184),
            "GPU-bbbb": (H200_TOTAL, H200_RESERVED, 140 * GIB),
        }
    )


async def test_nvml_all_devices_v2_struct() -> None:
    nvml = two_gpus()
    signals = await parse_gpu_source("nvml", nvml=nvml).read(3.0)
    assert signals.source == "nvml"
    assert signals.devices[0] == DeviceMemory(
        ident="GPU-aaaa", free_bytes=H200_TOTAL - H200_RESERVED - 11289821184, total_bytes=H200_TOTAL
    )
    assert signals.free_bytes == H200_TOTAL - H200_RESERVED - 140 * GIB


async def test_nvml_selects_by_uuid_and_inits_once() -> None:
    nvml = two_gpus()
    source = parse_gpu_source("nvml:GPU-bbbb", nvml=nvml)
    for now in (1.0, 2.0, 3.0):
        signals = await source.read(now)
        assert [d.ident for d in signals.devices] == ["GPU-bbbb"]
    assert nvml.init_calls == 1
    await source.aclose()
    assert nvml.shutdown_calls == 1


async def test_nvml_unknown_uuid_lists_existing_ones() -> None:
    with pytest.raises(GpuSourceError) as info:
        await parse_gpu_source("nvml:GPU-cccc", nvml=two_gpus()).read(0.0)
    assert info.value.message == "nvml:GPU-cccc: no GPU with UUID GPU-cccc (NVML reports: GPU-aaaa, GPU-bbbb)"


async def test_nvml_library_missing_says_what_to_do() -> None:
    nvml = FakeNvml({}, init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    source = NvmlSource(nvml=nvml)
    with pytest.raises(GpuSourceError) as info:
        await source.read(0.0)
    message = info.value.message
    assert "NVML is not available" in message and "NVIDIA driver" in message
    assert "Kubernetes" in message and "dcgm:" in message and "file:" in message
    # Not remembered as initialised: a later read tries again (the driver may come up).
    with pytest.raises(GpuSourceError):
        await source.read(1.0)
    assert nvml.init_calls == 2


async def test_nvml_sees_no_gpu() -> None:
    with pytest.raises(GpuSourceError, match="NVML sees no GPU"):
        await NvmlSource(nvml=FakeNvml({})).read(0.0)


async def test_nvml_lost_gpu_is_reported_and_handles_are_resolved_again() -> None:
    nvml = two_gpus()
    source = NvmlSource(["GPU-aaaa"], nvml=nvml)
    await source.read(0.0)
    nvml.lost.add("GPU-aaaa")
    with pytest.raises(GpuSourceError, match="GPU GPU-aaaa is lost"):
        await source.read(1.0)
    nvml.lost.clear()
    assert (await source.read(2.0)).devices[0].ident == "GPU-aaaa"


@pytest.mark.gpu
async def test_real_nvml_reads_every_visible_gpu() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    try:
        uuids = [
            pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
    finally:
        pynvml.nvmlShutdown()
    source = parse_gpu_source("nvml")
    try:
        everything = await source.read(0.0)
        assert [d.ident for d in everything.devices] == uuids
        for d in everything.devices:
            assert 0 <= d.free_bytes <= d.total_bytes
        chosen = await parse_gpu_source(f"nvml:{uuids[-1]}").read(0.0)
        assert [d.ident for d in chosen.devices] == [uuids[-1]]
    finally:
        await source.aclose()


# --------------------------------------------------------------------------------------------------
# Start-up check and GpuPoller
# --------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 0.5
        return self.t


async def test_check_reads_once_or_raises(tmp_path: Path) -> None:
    path = write(tmp_path / "gpu.json", {"free_bytes": 1, "total_bytes": 2})
    clock = FakeClock()
    # The file was just written, so the reading is about as old as the clock's "now" at the read.
    assert (await check(FileSource(path), clock=clock)).observed_at == pytest.approx(100.5, abs=1)
    assert (await GpuPoller(FileSource(path), clock=clock).check()).observed_at == pytest.approx(101.0, abs=1)
    # A file its writer has not created yet is no reading (stale), not a start-up failure...
    assert await GpuPoller(FileSource(tmp_path / "missing.json")).check() is None
    # ...but a directory that does not exist can never get one: that is an error.
    with pytest.raises(GpuSourceError, match=r"directory .* does not exist"):
        await GpuPoller(FileSource(tmp_path / "no-such-dir" / "gpu.json")).check()


async def collect(run, n: int, on_each: Callable[[object, SourceHealth], None] | None = None) -> list:
    updates: list[tuple[object, SourceHealth]] = []
    enough = asyncio.Event()

    def on_update(value: object, health: SourceHealth) -> None:
        updates.append((value, health))
        if on_each is not None:
            on_each(value, health)
        if len(updates) >= n:
            enough.set()

    task = asyncio.create_task(run(on_update))
    try:
        await asyncio.wait_for(enough.wait(), timeout=10)  # a safety net, not a timed assertion
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    return updates[:n]


async def test_poller_reports_failures_then_recovery(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"

    def appear_after_two_failures(value: object, health: SourceHealth) -> None:
        if health.consecutive_failures == 2:
            write(path, {"free_bytes": 5 * GIB, "total_bytes": 96 * GIB})

    poller = GpuPoller(FileSource(path), interval_s=0.001, clock=FakeClock())
    updates = await collect(poller.run, 3, appear_after_two_failures)

    (v0, h0), (v1, h1), (v2, h2) = updates
    assert v0 is None and h0.consecutive_failures == 1 and h0.last_ok_at is None
    assert h0.last_error == f"file:{path}: {path} {NOT_YET}"
    assert v1 is None and h1.consecutive_failures == 2
    assert isinstance(v2, GpuSignals) and v2.free_bytes == 5 * GIB
    assert h2.consecutive_failures == 0 and h2.last_error is None and h2.last_ok_at is not None


async def test_poller_survives_a_source_that_raises_anything() -> None:
    class Flaky:
        spec = "flaky"

        def __init__(self) -> None:
            self.calls = 0

        async def read(self, now: float) -> GpuSignals:
            self.calls += 1
            if self.calls == 1:
                raise KeyError("bug")
            return GpuSignals(observed_at=now, source=self.spec, devices=(DeviceMemory("x", 1, 2),))

        async def aclose(self) -> None:
            return None

    updates = await collect(GpuPoller(Flaky(), interval_s=0.001, clock=FakeClock()).run, 2)
    assert updates[0][0] is None and updates[0][1].last_error == "'bug'"
    assert isinstance(updates[1][0], GpuSignals)


def test_poller_rejects_a_non_positive_interval() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        GpuPoller(FileSource("/x"), interval_s=0)


class _Proc:
    def __init__(self, used: int | None) -> None:
        self.usedGpuMemory = used
        self.pid = 1


async def test_nvml_reports_what_other_processes_hold(tmp_path: Path) -> None:
    """Every compute process but the largest (the engine) is a neighbour whose growth the budget sees."""
    import types

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlMemory_v2=2,
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetMemoryInfo=lambda h, version: types.SimpleNamespace(free=GIB, total=96 * GIB),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [_Proc(90 * GIB), _Proc(676 * 2**20), _Proc(GIB)],
    )
    got = await parse_gpu_source("nvml:GPU-a", nvml=fake).read(1.0)
    assert got.other_process_bytes == 676 * 2**20 + GIB
    fake.nvmlDeviceGetComputeRunningProcesses = lambda h: [_Proc(90 * GIB), _Proc(None)]  # not reported
    assert (await parse_gpu_source("nvml:GPU-a", nvml=fake).read(1.0)).other_process_bytes is None

    path = write(tmp_path / "gpu.json", {"free_bytes": GIB, "total_bytes": 2 * GIB, "other_process_bytes": 5})
    assert (await parse_gpu_source(f"file:{path}").read(1.0)).other_process_bytes == 5


async def test_nvml_is_called_off_the_event_loop() -> None:
    """NVML calls block in the driver (and for long on a failing GPU): never on the loop's thread."""
    import threading

    class Recording(FakeNvml):
        def __init__(self, gpus: dict[str, tuple[int, int, int]]) -> None:
            super().__init__(gpus)
            self.threads: list[threading.Thread] = []

        def nvmlInit(self) -> None:
            self.threads.append(threading.current_thread())
            super().nvmlInit()

        def nvmlDeviceGetMemoryInfo(self, handle: str, version: int | None = None) -> Any:
            self.threads.append(threading.current_thread())
            return super().nvmlDeviceGetMemoryInfo(handle, version)

    nvml = Recording({"GPU-a": (96 * GIB, GIB, 10 * GIB)})
    source = NvmlSource(nvml=nvml)
    signals = await source.read(1.0)
    assert signals.free_bytes == 85 * GIB
    assert len(nvml.threads) == 2
    assert threading.current_thread() not in nvml.threads
