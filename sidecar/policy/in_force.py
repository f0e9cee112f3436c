"""The rules in force: the decision's plain values (``Rules``) built from a validated policy and what
the lane has taught the sidecar (``Learned``). The one place that reads the pydantic model on the
decision's and the shell's behalf, and the one place that resolves ``vram.idle_free_bytes: auto``."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, TypeVar

from pydantic import BaseModel

from sidecar.core import facts
from sidecar.core.rules import (
    NOTHING_LEARNED,
    CostModel,
    ExperimentalRules,
    GuardRules,
    HeadroomSource,
    HoldRules,
    KvRules,
    LaneRules,
    Learned,
    LimitRules,
    MambaRules,
    MonitorRules,
    Rules,
    SignalRules,
    VramRules,
)
from sidecar.policy.schema import Policy, Vram

T = TypeVar("T", bound=Any)


def rules_in_force(p: Policy, learned: Learned = NOTHING_LEARNED) -> Rules:
    """The rules in force: the policy's sections under the core's names (a new field is added to both,
    nothing here), with the margin and the idle figure the lane taught (``learned``)."""
    cost = _view(CostModel, p.cost)
    if learned.margin is not None:
        cost = replace(cost, margin=learned.margin)
    rules = Rules(
        lane=_view(LaneRules, p.lane),
        cost=cost,
        vram=_vram(p.vram, learned),
        kv=_view(KvRules, p.kv),
        mamba=None if p.mamba is None else _view(MambaRules, p.mamba),
        engine_queue=LimitRules(p.engine_queue.max_requests, p.engine_queue.on_exceed),
        pending_prefill=LimitRules(p.pending_prefill.max_tokens, p.pending_prefill.on_exceed),
        engine=_view(SignalRules, p.engine),
        gpu=_view(SignalRules, p.gpu),
        hold=_view(HoldRules, p.hold),
        monitor=_view(MonitorRules, p.monitor),
        guard=_view(GuardRules, p.guard),
        max_sequences_per_request=p.limits.max_sequences_per_request,
        experimental=_view(ExperimentalRules, p.experimental),
    )
    # The lane facts measured to differ from the policy's: the safer figure (core/facts.py).
    return _per_device(facts.in_force(rules, learned.facts), learned)


def _per_device(rules: Rules, learned: Learned) -> Rules:
    """Each GPU's idle baseline (``decide.idle_budget``): the figure in force for the tightest GPU,
    the others as far above it as they measured at idle, each with what its other processes held
    then. One GPU, or nothing measured: the one figure."""
    devices, vram = learned.idle_devices, rules.vram
    if len(devices) < 2 or vram.idle_free_bytes is None:
        return rules
    tight = min(d.free_bytes for d in devices)
    spread = tuple(replace(d, free_bytes=vram.idle_free_bytes + d.free_bytes - tight) for d in devices)
    return replace(rules, vram=replace(vram, idle_devices=spread))


def rules_of(p: Policy) -> Rules:
    """The policy's own rules, before the lane has taught anything."""
    return rules_in_force(p, NOTHING_LEARNED)


def _vram(v: Vram, learned: Learned) -> VramRules:
    """``idle_free_bytes: auto`` is no figure until the sidecar has measured it: until then the
    headroom is live GPU free memory and no transient is unfit for its size alone; then the measured
    figure, with what other processes held then unless the policy says."""
    vram = _view(VramRules, v)
    if not v.idle_free_auto:
        return vram
    if learned.idle_free_bytes is None:
        return replace(vram, headroom=HeadroomSource.NVML_FREE, idle_free_bytes=None, idle_free_auto=True)
    other = v.other_processes_bytes
    return replace(
        vram,
        idle_free_bytes=learned.idle_free_bytes,
        other_processes_bytes=learned.idle_other_process_bytes if other is None else other,
        idle_free_auto=True,
    )


def _view(cls: type[T], section: BaseModel) -> T:
    """``cls`` filled from the section's fields of the same names (pydantic keeps sizes as plain ints).
    A field of ``cls`` the section lacks keeps its default (``SignalRules.required`` on the engine)."""
    return cls(
        **{f.name: getattr(section, f.name) for f in fields(cls) if f.name in type(section).model_fields}
    )
