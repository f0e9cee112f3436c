"""``check-policy --upstream URL --gpu-source SPEC``: a policy against a live lane, before it is deployed.

One engine read (``/metrics``, ``/v1/loads``, ``/server_info``: the scraper the sidecar runs) and one GPU
read, compared fact by fact with the policy (``sidecar/core/facts.py``, the comparison ``serve`` makes
while it runs). Idle free memory is compared only where the engine is idle at the read (nothing
running or waiting): otherwise GPU free memory is not the idle figure, and the line says so.
"""

from __future__ import annotations

import time

from sidecar.core import facts as lane_facts
from sidecar.core.facts import Fact
from sidecar.core.rules import Rules
from sidecar.signals.engine import EngineScraper, EngineUnavailable
from sidecar.signals.gpu import GpuSource

UNITS = {
    "idle_free_bytes": "MiB",
    "kv_pool_tokens": "tokens",
    "mamba_slots": "slots",
    "context_len": "tokens",
    "chunked_prefill_size": "tokens",
    "gpus": "GPUs",
}


async def measure(own: Rules, upstream: str, gpu: GpuSource | None) -> tuple[tuple[Fact, ...], list[str]]:
    """The lane facts of a policy (its own rules: ``rules_of``) against the lane at ``upstream`` (and
    its GPUs), and notes."""
    notes: list[str] = []
    async with EngineScraper(upstream, interval_s=1.0) as scraper:
        try:
            engine = await scraper.poll_once()
        except EngineUnavailable as e:
            raise LaneUnreadable(str(e)) from e
    g = await gpu.read(time.monotonic()) if gpu is not None else None
    idle = engine.running_requests == 0 and engine.queue_requests == 0
    idle_free = g.free_bytes if g is not None and idle else None
    if g is None:
        notes.append("idle_free_bytes: no GPU source given (--gpu-source): not compared")
    elif not idle:
        notes.append(
            f"idle_free_bytes: the engine is busy ({engine.running_requests} running, "
            f"{engine.queue_requests} waiting): GPU free memory is not its idle figure; not compared"
        )
    elif own.vram.idle_free_auto:
        notes.append(f"idle_free_bytes: auto in the policy; measured now {g.free_bytes / 2**20:,.0f} MiB")
    found = lane_facts.compare(
        own,
        engine,
        idle_free,
        len(g.devices) if g is not None and g.devices else None,
        idle_free_policy=own.vram.idle_free_bytes,
    )
    return found, notes


class LaneUnreadable(Exception):
    """The engine could not be read."""


def render(found: tuple[Fact, ...]) -> list[str]:
    """One line per fact both sides state: agrees, or disagrees with what is in force and why."""
    lines = []
    for f in found:
        if f.policy is None or f.measured is None:
            continue
        unit = UNITS.get(f.name, "")

        def show(v: int | None, unit: str = unit) -> str:
            if v is None:
                return "-"
            return f"{v / 2**20:,.0f} MiB" if unit == "MiB" else f"{v:,} {unit}"

        if not f.disagrees:
            within = (
                "" if f.in_force == f.policy else f" (within the tolerance; serve uses {show(f.in_force)})"
            )
            lines.append(f"  {f.name}: policy {show(f.policy)}, lane {show(f.measured)}: agree{within}")
            continue
        if f.in_force is None:
            then = "the GPU source reads other GPUs than the engine runs on: fix --gpu-source"
        elif f.unsafe:
            then = f"the policy claims more than the lane has; serve uses {show(f.in_force)}"
        else:
            then = f"serve uses {show(f.in_force)}"
        lines.append(f"  {f.name}: policy {show(f.policy)}, lane {show(f.measured)}: DISAGREE ({then})")
    return lines
