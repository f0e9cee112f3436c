"""Device memory for the engine model: modeled arithmetic by default, real CUDA memory on request.

The engine model asks its device for each transient allocation and releases them all when the step
ends. :class:`ModeledDevice` does this with integers and never touches a GPU. :class:`TorchDevice`
(``cuda=True``) makes the same calls with ``torch.empty(..., device="cuda")`` so that the crash is
CUDA's own ``OutOfMemoryError`` and the free memory is what NVML reports; ``torch`` is imported only
when one is constructed, so CPU-only machines never import it.
"""

from __future__ import annotations

from typing import Any, Protocol

from sidecar_emulator.profiles import GiB, LaneProfile, MiB


class OutOfMemory(Exception):
    """An allocation did not fit. ``message`` is what the engine's log would show."""

    def __init__(self, requested_bytes: int, free_bytes: int, message: str) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes
        self.message = message


class Device(Protocol):
    """What the engine model needs from device memory."""

    total_bytes: int

    def free_bytes(self) -> int:
        """Free memory as NVML would report it right now."""

    def allocate(self, nbytes: int) -> None:
        """Allocate a transient for the current step; raise :class:`OutOfMemory` if it does not fit."""

    def release_transients(self) -> None:
        """The step ended: its transients are freed (a caching allocator may keep them reserved)."""

    def crash(self) -> None:
        """The engine process died: everything it held is freed."""

    def restart(self) -> None:
        """The engine process is back: its static allocations are held again."""

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: free cached blocks go back to the driver (NVML sees them free)."""


def oom_message(requested: int, free: int, total_visible: int, process_bytes: int) -> str:
    """PyTorch's wording, so logs and error strings read like the real crash."""
    return (
        f"CUDA out of memory. Tried to allocate {requested / MiB:.2f} MiB. GPU 0 has a total capacity of "
        f"{total_visible / GiB:.2f} GiB of which {free / MiB:.2f} MiB is free. Including non-PyTorch "
        f"memory, this process has {process_bytes / GiB:.2f} GiB memory in use."
    )


class ModeledDevice:
    """Integer bookkeeping of one device shared by the engine and whatever else the profile names."""

    def __init__(self, profile: LaneProfile) -> None:
        self.profile = profile
        self.total_bytes = profile.device_total_bytes
        self._idle_free = profile.idle_free_bytes
        self.other_process_bytes = profile.other_process_bytes
        self._live = 0
        self._cached = 0
        self._down = False
        # ``allocator_segments``: each segment's size and what the current step uses of it.
        self._segments: list[list[int]] = []

    def set_other_process_bytes(self, nbytes: int) -> None:
        """Another process on the card grows or shrinks: it takes or gives back the engine's room."""
        self._idle_free -= nbytes - self.other_process_bytes
        self.other_process_bytes = nbytes

    def free_bytes(self) -> int:
        if self._down:
            p = self.profile
            return p.device_total_bytes - p.device_reserved_bytes - self.other_process_bytes
        if self.profile.allocator_segments:
            return self._idle_free - sum(size for size, _used in self._segments)
        held = max(self._live, self._cached) if self.profile.allocator_caches_transients else self._live
        return self._idle_free - held

    @property
    def live_transient_bytes(self) -> int:
        return self._live

    def allocate(self, nbytes: int) -> None:
        if self.profile.allocator_segments:
            self._allocate_segment(nbytes)
            return
        # An out-of-memory retry in PyTorch releases the cache first: only live bytes decide.
        free = self._idle_free - self._live
        if nbytes > free:
            p = self.profile
            process = p.engine_static_bytes + self._live
            visible = p.device_total_bytes - p.device_reserved_bytes
            raise OutOfMemory(nbytes, free, oom_message(nbytes, free, visible, process))
        self._live += nbytes
        self._cached = max(self._cached, self._live)

    def _allocate_segment(self, nbytes: int) -> None:
        """PyTorch's default allocator, per step: best fit in a segment's free tail, else a new segment
        (2 MiB granularity); when the driver has no room, the free segments are released and it retries."""
        fits = [s for s in self._segments if s[0] - s[1] >= nbytes]
        if fits:
            best = min(fits, key=lambda s: s[0] - s[1])
            best[1] += nbytes
            self._live += nbytes
            return
        size = -(-nbytes // (2 * MiB)) * (2 * MiB)
        if sum(s[0] for s in self._segments) + size > self._idle_free:
            self.empty_cache()  # the out-of-memory retry: release every free segment, then try again
        in_use = sum(s[0] for s in self._segments)
        if in_use + size > self._idle_free:
            p = self.profile
            free = self._idle_free - in_use
            visible = p.device_total_bytes - p.device_reserved_bytes
            raise OutOfMemory(
                nbytes, free, oom_message(nbytes, free, visible, p.engine_static_bytes + in_use)
            )
        self._segments.append([size, nbytes])
        self._live += nbytes

    def release_transients(self) -> None:
        self._live = 0
        for s in self._segments:
            s[1] = 0

    def empty_cache(self) -> None:
        self._cached = self._live
        self._segments = [s for s in self._segments if s[1] > 0]

    def crash(self) -> None:
        self._live = 0
        self._cached = 0
        self._segments = []
        self._down = True

    def restart(self) -> None:
        self._down = False


def static_blocks(profile: LaneProfile, free_at_start: int, *, fill_to_profile: bool = True) -> list[int]:
    """The blocks :class:`TorchDevice` allocates at start on a card with ``free_at_start`` bytes free.

    What the engine model's crash point depends on is the idle free memory (``profile.idle_free_bytes``),
    not the card's size: the pool is bookkept in tokens. So the profile's static blocks (weights, KV and
    Mamba pools, graphs) are allocated as they are when they leave at least the idle free memory, plus a
    ballast down to it (``fill_to_profile``); on a card too small for them (the 141 GB profiles on an
    80 GB H100) each block is scaled down in proportion so that the card is left with exactly the
    profile's idle free memory. ``free_at_start`` is what the card shows free before (NVML / torch).
    """
    p = profile
    blocks = [b for b in (p.weights_bytes, p.kv_pool_bytes, p.mamba_pool_bytes, p.cuda_graph_bytes) if b > 0]
    target = (
        free_at_start - p.idle_free_bytes
    )  # what must be held so that the idle free memory is the profile's
    if target <= 0:
        raise RuntimeError(
            f"the card has {free_at_start / MiB:,.0f} MiB free, no more than profile {p.name!r}'s idle free "
            f"memory ({p.idle_free_bytes / MiB:,.0f} MiB): nothing to emulate"
        )
    held = sum(blocks)
    if held > target:
        scaled = [b * target // held for b in blocks]
        scaled[0] += target - sum(scaled)  # integer rounding goes to the largest (weights) block
        return scaled
    if fill_to_profile and target > held:
        blocks.append(target - held)
    return blocks


class TorchDevice:
    """Real device memory through PyTorch (``cuda=True``); needs torch and a CUDA GPU.

    At start it allocates the profile's static memory (:func:`static_blocks`: scaled down on a card
    smaller than the profile's, with a ballast on a larger one) so that the real free memory equals the
    profile's idle free memory, and the same workload runs out of memory at the same point on an 80 GB
    H100 as on a 141 GB H200. Free memory is read from the device (``torch.cuda.mem_get_info``, the same
    number as NVML ``free``).
    """

    def __init__(self, profile: LaneProfile, *, device_index: int = 0, fill_to_profile: bool = True) -> None:
        import torch  # lazy: only the cuda mode may import torch

        if not torch.cuda.is_available():
            raise RuntimeError("cuda=True needs a CUDA GPU visible to PyTorch")
        self._torch = torch
        self.profile = profile
        self._dev = torch.device("cuda", device_index)
        self._fill = fill_to_profile
        self._static: list[Any] = []
        self._transients: list[Any] = []
        _free, total = torch.cuda.mem_get_info(self._dev)
        self.total_bytes = int(total)
        self._allocate_static()

    def _empty(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self._dev)

    def _allocate_static(self) -> None:
        free, _total = self._torch.cuda.mem_get_info(self._dev)
        for nbytes in static_blocks(self.profile, int(free), fill_to_profile=self._fill):
            self._static.append(self._empty(nbytes))

    def free_bytes(self) -> int:
        free, _total = self._torch.cuda.mem_get_info(self._dev)
        return int(free)

    def allocate(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        try:
            self._transients.append(self._empty(nbytes))
        except self._torch.cuda.OutOfMemoryError as exc:  # the real crash
            raise OutOfMemory(nbytes, self.free_bytes(), str(exc).splitlines()[0]) from exc

    def release_transients(self) -> None:
        self._transients.clear()  # freed into PyTorch's cache, as in the real engine

    def empty_cache(self) -> None:
        self._torch.cuda.empty_cache()

    def crash(self) -> None:
        self._transients.clear()
        self._static.clear()
        self._torch.cuda.empty_cache()  # the process is gone: NVML sees its memory free

    def restart(self) -> None:
        self._allocate_static()


class TensorParallelDevice:
    """The GPUs of a tensor-parallel engine, one device per rank (evidence B5).

    Every rank runs the same step, so every transient is asked of every rank (the profile's figures
    are per rank); the first rank that cannot allocate kills the engine, as one scheduler process's
    out-of-memory error takes the whole TP group down. NVML-like readings are per rank
    (:meth:`readings`); ``free_bytes`` is the smallest, the one that decides.
    """

    def __init__(self, ranks: list[Any]) -> None:
        if not ranks:
            raise ValueError("a tensor-parallel device needs at least one rank")
        self.ranks = ranks
        self.total_bytes = ranks[0].total_bytes

    def free_bytes(self) -> int:
        return min(r.free_bytes() for r in self.ranks)

    def readings(self) -> list[tuple[int, int, int | None]]:
        """(free, total, other processes' bytes) of every rank's GPU, in rank order."""
        return [(r.free_bytes(), r.total_bytes, getattr(r, "other_process_bytes", None)) for r in self.ranks]

    @property
    def other_process_bytes(self) -> int | None:
        known = [getattr(r, "other_process_bytes", None) for r in self.ranks]
        return None if any(k is None for k in known) else max(k for k in known if k is not None)

    def set_other_process_bytes(self, nbytes: int, rank: int | None = None) -> None:
        """A neighbour changes on one rank's GPU (``rank``), or on every one (None)."""
        for i, r in enumerate(self.ranks):
            if rank is None or i == rank:
                r.set_other_process_bytes(nbytes)

    def allocate(self, nbytes: int) -> None:
        for i, r in enumerate(self.ranks):
            try:
                r.allocate(nbytes)
            except OutOfMemory as oom:
                raise OutOfMemory(
                    oom.requested_bytes, oom.free_bytes, f"[TP rank {i}] {oom.message}"
                ) from oom

    def release_transients(self) -> None:
        for r in self.ranks:
            r.release_transients()

    def empty_cache(self) -> None:
        for r in self.ranks:
            r.empty_cache()

    def crash(self) -> None:
        for r in self.ranks:
            r.crash()

    def restart(self) -> None:
        for r in self.ranks:
            r.restart()


def rank_profiles(profile: LaneProfile) -> list[LaneProfile]:
    """One profile per rank: the same figures, each with its own GPU's neighbours at start."""
    others = profile.rank_other_process_bytes or (profile.other_process_bytes,) * profile.tp_size
    if len(others) != profile.tp_size:
        raise ValueError(f"rank_other_process_bytes has {len(others)} entries for tp_size {profile.tp_size}")
    return [profile.replace(other_process_bytes=o) for o in others]


def modeled(profile: LaneProfile) -> Any:
    """The modeled device of a lane: one GPU, or one per rank under tensor parallelism."""
    if profile.tp_size <= 1 and not profile.rank_other_process_bytes:
        return ModeledDevice(profile)
    return TensorParallelDevice([ModeledDevice(p) for p in rank_profiles(profile)])


def on_cuda(profile: LaneProfile) -> Any:
    """Real CUDA memory: one GPU, or one per rank (rank i on CUDA device i) under tensor parallelism."""
    if profile.tp_size <= 1:
        return TorchDevice(profile)
    ranks = [TorchDevice(p, device_index=i) for i, p in enumerate(rank_profiles(profile))]
    return TensorParallelDevice(ranks)
