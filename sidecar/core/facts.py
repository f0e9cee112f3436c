"""Lane facts: what the policy says about the lane against what the sidecar measured on it.

Pure: the shell (``sidecar/admission/lane_watch.py``) passes in the engine's last report, the idle
figure it measured and the GPUs its source reads; ``compare`` says, per fact, both figures, the one in
force and whether they disagree beyond the tolerance; ``in_force`` puts the safer figures into the
rules. ``check-policy --upstream`` runs the same comparison before a policy is deployed.

The figure in force is always the safer one, however small the difference: a policy that claims
40 MiB more idle free memory than measured hands out 40 MiB that are not there. The tolerance only
decides what is *loud*: ``disagrees`` (the warning, the disagreement metric and its alert).

Which figure is safer:

* ``idle_free_bytes``: the smaller. A policy that claims more idle free memory than the lane has
  hands out memory that is not there; a measurement below the truth (a caching allocator's low-water
  mark, taken after traffic) only admits less.
* ``kv_pool_tokens``, ``mamba_slots``, ``context_len``, ``chunked_prefill_size``: the engine's own
  report. It is what the engine runs with (the decision already prefers it where it has it, and
  prices each prompt's chunks at the engine's chunk); a figure in the policy that differs describes
  another lane.
* ``gpus``: the engine's GPUs (tensor x pipeline parallel) against the devices the GPU source reads.
  Nothing to put in force: a GPU source that reads other GPUs than the engine's measures the wrong
  card, and only the operator can fix that; it is shown and alerted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from sidecar.core.rules import Rules
from sidecar.core.snapshot import EngineSignals

# Idle free memory moves by a few MiB between readings (CUDA context, allocator blocks of 2 MiB):
# a disagreement (warned, counted, alerted) is more than this relative share of the policy's figure
# and more than the bytes. The figure in force is the smaller one whatever the difference.
IDLE_FREE_TOLERANCE = 0.02
IDLE_FREE_TOLERANCE_BYTES = 64 * 2**20

Safer = Literal["smaller", "measured", "none"]


@dataclass(frozen=True, slots=True)
class Fact:
    """One lane fact: the policy's figure, the measured one (None: not measured yet, or the policy
    gives none), the one in force (the safer, even within the tolerance), and whether the two
    disagree beyond the tolerance (what is warned of and alerted). ``unsafe``: they disagree and the
    policy's figure is the less safe one (it promises more than the lane has)."""

    name: str
    policy: int | None
    measured: int | None
    in_force: int | None
    disagrees: bool
    unsafe: bool

    def fields(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "measured": self.measured,
            "in_force": self.in_force,
            "disagrees": self.disagrees,
            "unsafe": self.unsafe,
        }


def _fact(name: str, policy: int | None, measured: int | None, safer: Safer) -> Fact:
    if policy is None or measured is None:
        # One side only: nothing to compare; its figure is in force, save a GPU count (never in force).
        shown = None if safer == "none" else measured if policy is None else policy
        return Fact(name, policy, measured, shown, False, False)
    if name == "idle_free_bytes":
        slack = max(IDLE_FREE_TOLERANCE * policy, IDLE_FREE_TOLERANCE_BYTES)
        disagrees = abs(policy - measured) > slack
    else:
        disagrees = policy != measured
    if safer == "smaller":
        in_force = min(policy, measured)  # within the tolerance too: only the warning waits for it
        unsafe = disagrees and policy > measured
    elif safer == "measured":
        in_force, unsafe = measured, disagrees
    else:
        in_force, unsafe = None, disagrees
    return Fact(name, policy, measured, in_force, disagrees, unsafe)


def compare(
    rules: Rules,
    engine: EngineSignals | None,
    idle_free_bytes: int | None,
    gpu_devices: int | None,
    *,
    idle_free_policy: int | None,
) -> tuple[Fact, ...]:
    """Every lane fact, policy against measurement. ``rules`` are the policy's own (no fact applied);
    ``idle_free_policy``: the policy's idle figure (None for ``auto``, whose figure is the measurement
    itself); ``gpu_devices``: how many devices the GPU source reads (None: no reading)."""
    lane, e = rules.lane, engine
    gpus = e.gpus if e is not None else None
    facts = [
        _fact("idle_free_bytes", idle_free_policy, idle_free_bytes, "smaller"),
        _fact("kv_pool_tokens", lane.kv_pool_tokens, e.max_total_tokens if e else None, "measured"),
        _fact("mamba_slots", lane.mamba_slots, e.mamba_total_slots if e else None, "measured"),
        _fact("context_len", lane.context_len, e.context_len if e else None, "measured"),
        _fact(
            "chunked_prefill_size",
            lane.chunked_prefill_size,
            e.chunked_prefill_size if e and (e.chunked_prefill_size or 0) > 0 else None,
            "measured",
        ),
        _fact("gpus", gpus, gpu_devices if gpus is not None else None, "none"),
    ]
    return tuple(facts)


def overrides(facts: tuple[Fact, ...]) -> tuple[tuple[str, int], ...]:
    """Every fact the policy states whose figure in force is not the policy's, each with that figure
    (``rules.Learned.facts``): a difference within the tolerance included (it is not warned of, but
    the safer figure is in force)."""
    return tuple(
        (f.name, f.in_force)
        for f in facts
        if f.policy is not None and f.in_force is not None and f.in_force != f.policy
    )


def in_force(rules: Rules, forced: tuple[tuple[str, int], ...]) -> Rules:
    """The rules with the safer figure of every fact that differs from the policy's (``overrides``;
    the module docstring says which is safer)."""
    by = dict(forced)
    if not by:
        return rules
    lane = rules.lane
    lane = replace(
        lane,
        kv_pool_tokens=by.get("kv_pool_tokens", lane.kv_pool_tokens),
        mamba_slots=by.get("mamba_slots", lane.mamba_slots),
        context_len=by.get("context_len", lane.context_len),
        chunked_prefill_size=by.get("chunked_prefill_size", lane.chunked_prefill_size),
    )
    vram = rules.vram
    idle = by.get("idle_free_bytes")
    if idle is not None and vram.idle_free_bytes is not None:
        figure = min(vram.idle_free_bytes, idle)
        cap = vram.max_transient_bytes
        vram = replace(
            vram,
            idle_free_bytes=figure,
            # A transient cap the policy set above what the measured lane frees is no cap.
            max_transient_bytes=None if cap is None else min(cap, figure - vram.reserve_bytes),
        )
    return replace(rules, lane=lane, vram=vram)
