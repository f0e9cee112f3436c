"""GPU memory sources: where the sidecar reads live free memory of the engine's devices.

Spec strings (``--gpu-source`` / ``SIDECAR_GPU_SOURCE``):

* ``nvml`` - every GPU NVML sees on this host.
* ``nvml:<uuid>[,<uuid>...]`` - only these GPUs (``nvidia-smi -L`` prints the UUIDs). Select by
  UUID, never by index: NVML ignores ``CUDA_VISIBLE_DEVICES`` and enumerates every GPU of the host
  (or of the container), in an order that is not guaranteed to match CUDA's.
* ``dcgm:<url>[#<uuid>,<uuid>...]`` - a dcgm-exporter ``/metrics`` endpoint, for a Kubernetes sidecar
  container that has no GPU allocated and so cannot use NVML. The optional fragment keeps only those
  GPUs (a node's exporter reports every GPU on the node; take the UUIDs from the engine container's
  ``NVIDIA_VISIBLE_DEVICES``). The fragment is never sent to the exporter. dcgm-exporter samples
  every ``--collect-interval`` (30000 ms by default): lower it for admission control.
* ``file:<path>`` - a JSON file re-read on every poll: ``{"free_bytes": N, "total_bytes": N}``, or
  ``{"devices": [{"uuid": ..., "free_bytes": N, "total_bytes": N}, ...]}`` to emulate several GPUs.

Headroom is the minimum over the devices (`GpuSignals.free_bytes`): one full GPU stops a TP group.
The devices are fixed at the first good reading (``FixedDevices``): a later reading that lacks one
is a failed read, never a higher minimum.
NVML counts memory held by PyTorch's caching allocator as used, so its free is a conservative view
of the engine's headroom.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, Protocol
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sidecar.core.snapshot import DeviceMemory, GpuSignals, SourceHealth
from sidecar.signals.engine import Sooner, make_control_client, poll_forever
from sidecar.signals.worker import run_in_signal_thread

MIB = 1024 * 1024
# No GPU has a petabyte: a larger figure is a broken writer, and would open the gate wide.
MAX_DEVICE_BYTES = 1 << 50


class GpuSourceError(Exception):
    """A GPU source could not be read; the message says what to fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class GpuSource(Protocol):
    """One way of reading the engine's GPUs. ``spec`` is the string it was built from."""

    spec: str

    async def read(self, now: float) -> GpuSignals:
        """Free/total memory of every selected device, stamped ``now``; raises GpuSourceError."""
        ...

    async def aclose(self) -> None:
        """Release what the source holds (NVML handle, HTTP client)."""
        ...


class FixedDevices:
    """The devices a source reported on its first good reading: every later reading must report each
    of them, or it is a failed read.

    Why: headroom is the minimum over the devices, so a device that drops out of a reading raises it.
    With two cards in a ``file:`` source, a prompt held at 193 MB of headroom was admitted when one
    card vanished from the file (64.4 GB, nothing logged); ``dcgm:`` without a UUID list read the same
    way. NVML resolves its handles once and fails on a lost one; these sources now fail closed too.
    A device that appears later is kept (the minimum over more devices can only be lower).
    """

    def __init__(self) -> None:
        self.expected: tuple[str, ...] | None = None

    def confirm(self, devices: Sequence[DeviceMemory], where: str) -> None:
        idents = tuple(d.ident for d in devices)
        if self.expected is None:
            self.expected = idents
            return
        missing = [i for i in self.expected if i not in idents]
        if missing:
            raise GpuSourceError(
                f"{where}: GPU {', '.join(missing)} missing from the reading (the devices are fixed at the "
                f"first reading: {', '.join(self.expected)}); a reading without a device is a failed read"
            )


# --------------------------------------------------------------------------------------------------
# NVML
# --------------------------------------------------------------------------------------------------

_NO_NVML_HINT = (
    "install the NVIDIA driver (libnvidia-ml.so.1) on this host; in Kubernetes a sidecar container "
    "without the GPU allocated to it cannot see the GPU: use --gpu-source dcgm:<dcgm-exporter URL> "
    "or file:<path> instead"
)


def _is(exc: BaseException, nvml: Any, name: str) -> bool:
    cls = getattr(nvml, name, None)
    return isinstance(cls, type) and isinstance(exc, cls)


class NvmlSource:
    """Reads free memory through NVML (`nvidia-ml-py`, module `pynvml`), memory struct v2.

    `nvmlInit` runs once, lazily on the first read (it costs ~10 ms; a read costs ~6 µs, cheap
    enough for the poller to call directly). Handles are resolved once and dropped when a GPU is
    lost, so the next read resolves them again. ``nvml`` is the `pynvml` module; tests pass a fake.
    NVML ignores CUDA_VISIBLE_DEVICES: pass UUIDs to watch only the engine's GPUs.
    """

    def __init__(
        self,
        uuids: Sequence[str] | None = None,
        *,
        nvml: ModuleType | Any | None = None,
        spec: str | None = None,
    ) -> None:
        self.uuids = tuple(uuids) if uuids else None
        self.spec = spec or ("nvml:" + ",".join(self.uuids) if self.uuids else "nvml")
        self._nvml = nvml
        self._initialized = False
        self._handles: list[tuple[str, Any]] | None = None

    def _module(self) -> Any:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise GpuSourceError(
                    f"{self.spec}: the pynvml module is missing: pip install nvidia-ml-py"
                    " (not the deprecated `pynvml` package)"
                ) from exc
            self._nvml = pynvml
        return self._nvml

    def _fail(self, what: str, exc: Exception, uuid: str | None = None) -> GpuSourceError:
        nvml = self._module()
        on = f" {uuid}" if uuid else ""
        if _is(exc, nvml, "NVMLError_LibraryNotFound") or _is(exc, nvml, "NVMLError_DriverNotLoaded"):
            return GpuSourceError(f"{self.spec}: NVML is not available ({exc}): {_NO_NVML_HINT}")
        if _is(exc, nvml, "NVMLError_NoPermission"):
            return GpuSourceError(f"{self.spec}: {what}{on}: NVML denied access ({exc})")
        if _is(exc, nvml, "NVMLError_GpuIsLost") or _is(exc, nvml, "NVMLError_ResetRequired"):
            self._handles = None
            return GpuSourceError(
                f"{self.spec}: GPU{on} is lost ({exc}): it fell off the bus or needs a reset;"
                " the engine on it has most likely failed"
            )
        return GpuSourceError(f"{self.spec}: {what}{on}: {type(exc).__name__}: {exc}")

    def _init(self) -> Any:
        nvml = self._module()
        if not self._initialized:
            try:
                nvml.nvmlInit()
            except Exception as exc:
                raise self._fail("nvmlInit", exc) from exc
            self._initialized = True
        return nvml

    def _all_devices(self, nvml: Any) -> list[tuple[str, Any]]:
        try:
            count = nvml.nvmlDeviceGetCount()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            return [(str(nvml.nvmlDeviceGetUUID(h)), h) for h in handles]
        except Exception as exc:
            raise self._fail("listing devices", exc) from exc

    def _resolve(self, nvml: Any) -> list[tuple[str, Any]]:
        if self.uuids is None:
            devices = self._all_devices(nvml)
            if not devices:
                raise GpuSourceError(f"{self.spec}: NVML sees no GPU on this host")
            return devices
        resolved = []
        for uuid in self.uuids:
            try:
                resolved.append((uuid, nvml.nvmlDeviceGetHandleByUUID(uuid)))
            except Exception as exc:
                if not (_is(exc, nvml, "NVMLError_NotFound") or _is(exc, nvml, "NVMLError_InvalidArgument")):
                    raise self._fail("nvmlDeviceGetHandleByUUID", exc, uuid) from exc
                try:
                    known = ", ".join(u for u, _ in self._all_devices(nvml)) or "none"
                except GpuSourceError as listing:
                    known = f"unknown ({listing.message})"
                raise GpuSourceError(f"{self.spec}: no GPU with UUID {uuid} (NVML reports: {known})") from exc
        return resolved

    async def read(self, now: float) -> GpuSignals:
        # In a worker thread: NVML calls are blocking driver ioctls (~6 µs when the driver is well,
        # nvmlInit ~10 ms, and much longer on a GPU that is falling off the bus); the loop must not wait.
        return await run_in_signal_thread(self._read, now)

    def _read(self, now: float) -> GpuSignals:
        nvml = self._init()
        if self._handles is None:
            self._handles = self._resolve(nvml)
        devices = []
        for uuid, handle in self._handles:
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            except Exception as exc:
                raise self._fail("nvmlDeviceGetMemoryInfo", exc, uuid) from exc
            devices.append(
                DeviceMemory(uuid, int(mem.free), int(mem.total), self._other_process_bytes(nvml, handle))
            )
        return GpuSignals(observed_at=now, source=self.spec, devices=tuple(devices))

    @staticmethod
    def _other_process_bytes(nvml: Any, handle: Any) -> int | None:
        """Memory of every compute process on the device but the largest (taken to be the engine).

        None when NVML will not say (no permission, a container that cannot see the processes, or a
        driver that reports no per-process usage): the budget then cannot see a neighbour grow.
        """
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None
        used = [p.usedGpuMemory for p in procs if isinstance(getattr(p, "usedGpuMemory", None), int)]
        if len(used) != len(procs) or not used:
            return None
        return sum(used) - max(used)

    async def aclose(self) -> None:
        if self._initialized:
            self._initialized = False
            self._handles = None
            with contextlib.suppress(Exception):  # shutting down: nothing useful to do with an error
                await run_in_signal_thread(self._module().nvmlShutdown)


# --------------------------------------------------------------------------------------------------
# dcgm-exporter
# --------------------------------------------------------------------------------------------------

_FB = {"DCGM_FI_DEV_FB_FREE": "free", "DCGM_FI_DEV_FB_USED": "used", "DCGM_FI_DEV_FB_RESERVED": "reserved"}


def parse_dcgm(text: str, uuids: Sequence[str] | None = None, *, where: str = "dcgm") -> list[DeviceMemory]:
    """Device memory from a dcgm-exporter exposition (FB fields are MiB), in exposition order.

    A device is named by its `UUID` label (else its `gpu` index); MIG instances get ``/<GPU_I_ID>``
    appended. total = FREE + USED + RESERVED (RESERVED exists since DCGM 3; before it, USED included
    it). Raises GpuSourceError when the text is not Prometheus text, a field is missing or a
    requested UUID is absent.
    """
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:
        raise GpuSourceError(f"{where}: the response is not Prometheus text ({exc})") from exc
    fields: dict[str, dict[str, float]] = {}
    parents: dict[str, str] = {}
    for fam in families:
        for s in fam.samples:
            kind = _FB.get(s.name)
            if kind is None:
                continue
            base = s.labels.get("UUID") or s.labels.get("uuid") or s.labels.get("gpu")
            if not base:
                raise GpuSourceError(f"{where}: {s.name} has neither a UUID nor a gpu label: {s.labels}")
            ident = f"{base}/{s.labels['GPU_I_ID']}" if s.labels.get("GPU_I_ID") else base
            if not math.isfinite(s.value) or s.value < 0:
                raise GpuSourceError(f"{where}: {s.name} for {ident} is {s.value}")
            parents[ident] = base
            seen = fields.setdefault(ident, {})
            if kind not in seen:
                seen[kind] = s.value
            else:  # duplicate series should not happen; if they do, keep the pessimistic value
                seen[kind] = min(seen[kind], s.value) if kind == "free" else max(seen[kind], s.value)
    if not fields:
        raise GpuSourceError(
            f"{where}: no DCGM_FI_DEV_FB_FREE/DCGM_FI_DEV_FB_USED series: is this a dcgm-exporter"
            " /metrics, and are those fields in its counters CSV?"
        )
    if uuids:
        missing = [u for u in uuids if u not in parents.values() and u not in fields]
        if missing:
            known = ", ".join(sorted(set(parents.values())))
            raise GpuSourceError(
                f"{where}: GPU {', '.join(missing)} not exported (exporter reports: {known})"
            )
        fields = {k: v for k, v in fields.items() if k in uuids or parents[k] in uuids}
    devices = []
    for ident, f in fields.items():
        for needed in ("free", "used"):
            if needed not in f:
                name = next(n for n, k in _FB.items() if k == needed)
                raise GpuSourceError(f"{where}: {name} missing for GPU {ident}; add it to the counters CSV")
        total = f["free"] + f["used"] + f.get("reserved", 0.0)
        devices.append(
            DeviceMemory(ident=ident, free_bytes=round(f["free"] * MIB), total_bytes=round(total * MIB))
        )
    return devices


class DcgmSource:
    """Reads device memory from a dcgm-exporter `/metrics` endpoint over HTTP (httpx)."""

    def __init__(
        self,
        url: str,
        uuids: Sequence[str] | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        spec: str | None = None,
    ) -> None:
        self.url = url
        self.uuids = tuple(uuids) if uuids else None
        self.spec = spec or (f"dcgm:{url}" + ("#" + ",".join(self.uuids) if self.uuids else ""))
        self._owns_client = client is None
        self._client = client if client is not None else make_control_client()
        self.fixed = FixedDevices()

    async def read(self, now: float) -> GpuSignals:
        try:
            resp = await self._client.get(self.url, headers={"Accept": "text/plain; version=0.0.4"})
        except httpx.HTTPError as exc:
            raise GpuSourceError(
                f"{self.spec}: GET {self.url}: {type(exc).__name__}: {exc or 'no response'}"
                " — is dcgm-exporter running and reachable (its default port is 9400)?"
            ) from exc
        if resp.status_code != 200:
            raise GpuSourceError(
                f"{self.spec}: GET {self.url}: {resp.status_code} {resp.reason_phrase}".rstrip()
            )
        # A dcgm-exporter page is tens of KB for a multi-GPU host: parsed off the event loop.
        devices = await run_in_signal_thread(
            parse_dcgm, resp.text, self.uuids, where=f"{self.spec}: GET {self.url}"
        )
        self.fixed.confirm(devices, self.spec)
        return GpuSignals(observed_at=now, source=self.spec, devices=tuple(devices))

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


# --------------------------------------------------------------------------------------------------
# File
# --------------------------------------------------------------------------------------------------


def _byte_count(obj: dict[str, Any], key: str, where: str) -> int:
    if key not in obj:
        raise GpuSourceError(f"{where}: missing field {key!r}")
    value = obj[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GpuSourceError(f"{where}: {key!r} must be a non-negative integer of bytes, got {value!r}")
    if value > MAX_DEVICE_BYTES:
        raise GpuSourceError(f"{where}: {key!r} of {value:.3g} bytes is more than any GPU has (1 PiB)")
    return value


def _device_from(obj: object, ident: str, where: str) -> DeviceMemory:
    if not isinstance(obj, dict):
        raise GpuSourceError(f"{where}: expected an object, got {type(obj).__name__}")
    free, total = _byte_count(obj, "free_bytes", where), _byte_count(obj, "total_bytes", where)
    if free > total:
        raise GpuSourceError(f"{where}: free_bytes {free} is larger than total_bytes {total}")
    other = _byte_count(obj, "other_process_bytes", where) if "other_process_bytes" in obj else None
    return DeviceMemory(ident=ident, free_bytes=free, total_bytes=total, other_process_bytes=other)


def parse_gpu_file(text: str, path: str) -> list[DeviceMemory]:
    """Devices described by a GPU source file (see the module docstring for the two shapes)."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise GpuSourceError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise GpuSourceError(f'{path}: expected a JSON object like {{"free_bytes": N, "total_bytes": N}}')
    if "devices" not in obj:
        return [_device_from(obj, path, path)]
    listed = obj["devices"]
    if not isinstance(listed, list) or not listed:
        raise GpuSourceError(f"{path}: 'devices' must be a non-empty list")
    devices = []
    for i, dev in enumerate(listed):
        where = f"{path}: devices[{i}]"
        uuid = dev.get("uuid") if isinstance(dev, dict) else None
        if uuid is not None and not isinstance(uuid, str):
            raise GpuSourceError(f"{where}: 'uuid' must be a string, got {uuid!r}")
        devices.append(_device_from(dev, uuid or f"{path}[{i}]", where))
    return devices


class FileSource:
    """Reads a small JSON file on every poll: for emulators, tests, and exporters we do not speak.

    The reading is as old as the file's last change *as seen here*: a change of its content, inode,
    size or modification time since the previous poll marks it fresh at the poll that saw it, and
    nothing else does. So a writer that died shows up as stale signals instead of a frozen "free"
    value, even when its clock put the file's mtime in the future. Only the first read, with nothing
    seen before, takes its age from the mtime (a future one counts as now).
    Write it atomically (write + rename) and at least as often as the policy's ``gpu.max_age_s``.

    The file is opened non-blocking and read off the event loop, at most ``MAX_BYTES``: a FIFO, a
    device or a directory at the path is refused instead of blocking the whole proxy in ``open()``.
    """

    MAX_BYTES = 64 * 1024

    def __init__(self, path: str | Path, *, spec: str | None = None) -> None:
        self.path = Path(path)
        self.spec = spec or f"file:{path}"
        self._seen: tuple[object, ...] | None = None
        self._seen_at = 0.0
        self.fixed = FixedDevices()

    def _read_file(self) -> tuple[tuple[int, int, int], bytes, float]:
        """(inode, size, mtime_ns), the bytes and the mtime of the file; blocking, run in a thread."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise GpuSourceError(
                    f"{self.spec}: {self.path} is not a regular file ({_file_kind(st.st_mode)}); "
                    "write the JSON to a file and rename it into place"
                )
            data = os.read(fd, self.MAX_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > self.MAX_BYTES:
            raise GpuSourceError(f"{self.spec}: {self.path} is larger than {self.MAX_BYTES:,} bytes")
        return (st.st_ino, st.st_size, st.st_mtime_ns), data, st.st_mtime

    async def read(self, now: float) -> GpuSignals:
        try:
            fingerprint, data, mtime = await run_in_signal_thread(self._read_file)
            text = data.decode("utf-8")
        except FileNotFoundError as exc:
            raise GpuSourceError(
                f"{self.spec}: {self.path} does not exist (yet?): GPU signals are stale until its writer "
                "creates it"
            ) from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise GpuSourceError(f"{self.spec}: cannot read {self.path}: {exc}") from exc
        devices = parse_gpu_file(text, str(self.path))
        self.fixed.confirm(devices, self.spec)
        seen = (*fingerprint, data)
        if self._seen is None:
            self._seen_at = now - min(max(0.0, time.time() - mtime), now)
        elif seen != self._seen:
            self._seen_at = now
        self._seen = seen
        return GpuSignals(observed_at=self._seen_at, source=self.spec, devices=tuple(devices))

    async def first_read(self, now: float) -> GpuSignals | None:
        """Start-up. A file that does not exist *yet* is no reading (stale until its writer - an
        emulator, an exporter - starts; the policy's ``gpu.on_stale`` applies), so a sidecar started
        before its writer does not die. A directory that does not exist is a mistake: an error."""
        if not self.path.parent.is_dir():
            raise GpuSourceError(
                f"{self.spec}: directory {self.path.parent} does not exist: nothing can ever write "
                f"{self.path.name} there (a typo in the path?)"
            )
        if not self.path.exists():
            return None
        return await self.read(now)

    async def aclose(self) -> None:
        return None


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"


# --------------------------------------------------------------------------------------------------
# Spec parsing and polling
# --------------------------------------------------------------------------------------------------

_SPEC_FORMS = "nvml, nvml:<uuid>[,<uuid>...], dcgm:<http(s) URL>[#<uuid>,...], file:<path>"


def _uuid_list(text: str, spec: str) -> list[str]:
    uuids = [u.strip() for u in text.split(",")]
    if not all(uuids):
        raise ValueError(f"GPU source {spec!r}: empty UUID in the list; expected {_SPEC_FORMS}")
    return uuids


def parse_gpu_source(
    spec: str,
    *,
    http_client: httpx.AsyncClient | None = None,
    nvml: ModuleType | Any | None = None,
) -> GpuSource:
    """Build the source a spec string names. Raises ValueError with the accepted forms on a bad spec.

    Nothing is contacted here; `check()` at start-up reads once so a wrong source fails early.
    """
    spec = spec.strip()
    kind, sep, rest = spec.partition(":")
    if kind == "nvml":
        return NvmlSource(_uuid_list(rest, spec) if sep else None, nvml=nvml, spec=spec)
    if kind == "dcgm" and sep:
        url, hash_sign, fragment = rest.partition("#")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(
                f"GPU source {spec!r}: expected dcgm:<http(s) URL of a dcgm-exporter /metrics>,"
                " e.g. dcgm:http://127.0.0.1:9400/metrics"
            )
        uuids = _uuid_list(fragment, spec) if hash_sign else None
        return DcgmSource(url, uuids, client=http_client, spec=spec)
    if kind == "file" and sep:
        if not rest.strip():
            raise ValueError(f"GPU source {spec!r}: file: needs a path, e.g. file:/run/gpu.json")
        return FileSource(rest, spec=spec)
    raise ValueError(f"unknown GPU source {spec!r}; expected one of: {_SPEC_FORMS}")


async def check(source: GpuSource, *, clock: Callable[[], float] = time.monotonic) -> GpuSignals | None:
    """Read a source once, for start-up: a missing GPU source is an error, not a silent gap. None: a
    source that may legitimately have nothing yet (a ``file:`` whose writer has not started)."""
    first_read = getattr(source, "first_read", None)
    if first_read is not None:
        return await first_read(clock())
    return await source.read(clock())


class GpuPoller:
    """Polls one GPU source in the background and reports each attempt, like `EngineScraper.run`."""

    def __init__(
        self,
        source: GpuSource,
        *,
        interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.source = source
        self.interval_s = interval_s
        self._clock = clock
        # Reads sooner than ``interval_s`` while the gate wants them: a request that waited is admitted
        # only on a GPU reading taken since it began waiting (``core/decide.py``).
        self.sooner: Sooner | None = None
        # While ``idle()``, reads every ``idle_interval_s`` instead (as ``EngineScraper``'s).
        self.idle: Callable[[], bool] = lambda: False
        self.idle_interval_s: float | None = None

    def current_interval_s(self) -> float:
        idle = self.idle_interval_s
        return idle if idle is not None and self.idle() else self.interval_s

    async def check(self) -> GpuSignals | None:
        """One read now; raises GpuSourceError with the source's explanation."""
        return await check(self.source, clock=self._clock)

    async def read(self) -> GpuSignals:
        return await self.source.read(self._clock())

    async def run(self, on_update: Callable[[GpuSignals | None, SourceHealth], None]) -> NoReturn:
        """Poll forever at ``interval_s``; survives every error, stops when cancelled."""
        await poll_forever(
            self.read,
            on_update,
            interval_s=self.current_interval_s,
            clock=self._clock,
            name=f"gpu {self.source.spec}",
            expected=(GpuSourceError,),
            sooner=self.sooner,
        )
