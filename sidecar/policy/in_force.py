"""The rules in force: the decision's plain values (``Rules``) built from a validated policy.
The one place outside ``sidecar/policy/schema.py`` that reads the pydantic model on the decision's
behalf."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, TypeVar

from pydantic import BaseModel

from sidecar.core.rules import (
    CostModel,
    HeadroomSource,
    HoldRules,
    KvRules,
    LaneRules,
    LimitRules,
    MambaRules,
    Rules,
    SignalRules,
    VramRules,
)
from sidecar.policy.schema import Policy

T = TypeVar("T", bound=Any)


def rules_of(p: Policy) -> Rules:
    """The decision's view of a validated policy, built once per loaded policy. Each core section takes
    the policy section's fields of the same names (a new field is added to both, nothing here).

    ``vram.idle_free_bytes: auto`` is no figure yet: until the sidecar has measured it
    (``sidecar/admission/lane_watch.py`` then supplies it), the headroom is live GPU free memory and no transient
    is unfit for its size alone."""
    vram = _view(VramRules, p.vram)
    if p.vram.idle_free_auto:
        vram = replace(vram, headroom=HeadroomSource.NVML_FREE, idle_free_bytes=None)
    return Rules(
        lane=_view(LaneRules, p.lane),
        cost=_view(CostModel, p.cost),
        vram=vram,
        kv=_view(KvRules, p.kv),
        mamba=None if p.mamba is None else _view(MambaRules, p.mamba),
        engine_queue=LimitRules(p.engine_queue.max_requests, p.engine_queue.on_exceed),
        pending_prefill=LimitRules(p.pending_prefill.max_tokens, p.pending_prefill.on_exceed),
        engine=_view(SignalRules, p.engine),
        gpu=_view(SignalRules, p.gpu),
        hold=_view(HoldRules, p.hold),
    )


def _view(cls: type[T], section: BaseModel) -> T:
    """``cls`` filled from the section's fields of the same names (pydantic keeps sizes as plain ints).
    A field of ``cls`` the section lacks keeps its default (``SignalRules.required`` on the engine)."""
    return cls(
        **{f.name: getattr(section, f.name) for f in fields(cls) if f.name in type(section).model_fields}
    )
