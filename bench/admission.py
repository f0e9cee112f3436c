"""Admission quality: how much work a lane completes without a crash, against peers' rules and an oracle.

Runs scenarios in virtual time through the engine model (``sidecar/sim``) under eight gates - the engine
alone, the rules peers ship (``sidecar_emulator/baselines.py``), the sidecar with the lane's shipped policy,
and an oracle that sees the engine's true state - for several seeds and robustness settings. The tunable
baselines (concurrency cap, prefill-token budget, prompt-length limit) are swept per scenario on the
default setting and run everywhere else at their best setting (zero crashes first, then goodput).

Goodput is served tokens (prompt + output of completed requests) over the longer of the run's span and
the oracle's span on the same scenario, seed and setting, so a run that dies early is not flattered.

Robustness settings: slow signals (engine and GPU polled every 5 s, the engine publishing 10x less
often); every transient term x1.2; 5 % and 10 % noise; a neighbour growing at the instant a held
request is admitted. The noise is a seeded factor drawn uniformly from [1 - N %, 1 + N %] for every
transient piece and batch-join allocation (``EngineModel._noisy``): bounded, as a real allocation's
variation is (workspaces, allocator rounding). It was gaussian once; a gaussian's tail makes every gate
with a finite margin crash sooner or later over enough draws, so zero crashes would be a property of
the seeds, not of the gate; with a bounded factor a margin that covers 1 + N % is crash-free on every
seed, and one that does not is not.

The tables hold ``--seeds`` (3) seeds of every gate; the zero-crash check (``--crash-seeds``, 20) then
runs the sidecar alone on the further seeds of every scenario and setting, for its crashes only: a gate
whose margin does not cover a perturbation crashes on an unlucky draw, which three seeds rarely hold.

    make bench-admission ARGS="--quick"
    .venv/bin/python bench/admission.py [--quick] [--seeds N] [--crash-seeds N] [--gates G ...]
        [--policy-set KEY=VALUE ...] [--jobs N] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.policy.schema import LoadedPolicy, Policy, load_policy_file  # noqa: E402
from sidecar.policy.wording import humane, suggest  # noqa: E402
from sidecar_emulator import baselines as bl  # noqa: E402
from sidecar_emulator.engine import EngineModel  # noqa: E402
from sidecar_emulator.profiles import H200, MAXQ_BOUNDED, LaneProfile, MiB, get_profile  # noqa: E402
from sidecar_emulator.replay import Driver  # noqa: E402
from sidecar_emulator.scenario import (  # noqa: E402
    Agents,
    Burst,
    GpuEvent,
    Request,
    Requests,
    Rounds,
    Scenario,
    load_scenario,
)

GATES = [
    "none",
    "static-cap",
    "token-budget",
    "max-length",
    "gie-saturation",
    "smg-overload",
    "sidecar",
    "oracle",
]
SWEPT = {"static-cap", "token-budget", "max-length"}
# (lag, perturbation) pairs; the first is the default, each other one is a robustness setting on its own.
SETTINGS = [
    ("default", "none"),
    ("laggy", "none"),
    ("default", "x1.2"),
    ("default", "noise5"),
    ("default", "noise10"),
    ("default", "neighbour"),
]
SLOW_POLL_S = 5.0  # "slow signals": engine and GPU polled every 5 s ...
SLOW_PUBLISH = 10  # ... and the engine publishing 10x less often
# For 60 s: twice the 128 MiB reserve the Max-Q policies had when this was chosen (16 MiB now).
NEIGHBOUR_BYTES = 256 * MiB
RESULTS = ROOT / "bench" / "results"


# ------------------------------------------------------------------------------------------ lanes
def h200_qwen3next(fraction: float) -> LaneProfile:
    """An H200 serving a Qwen3-Next-class model (bounded-gather build) at ``--mem-fraction-static``
    ``fraction``: a lane no shipped policy was written for. Device figures from the ``h200`` profile,
    model figures (weights, KV and Mamba bytes, transient coefficients) from ``maxq-bounded``."""
    b = MAXQ_BOUNDED
    startup = H200.device_total_bytes - H200.device_reserved_bytes - H200.cuda_context_bytes
    pools = int(fraction * startup) - b.weights_bytes - b.mamba_pool_bytes
    idle_free = startup - int(fraction * startup) - b.cuda_graph_bytes
    return b.replace(
        name=f"h200-qwen3next-{fraction:.2f}",
        description=f"H200, Qwen3-Next-class model, bounded build, --mem-fraction-static {fraction}",
        device_total_bytes=H200.device_total_bytes,
        device_reserved_bytes=H200.device_reserved_bytes,
        other_process_bytes=0,
        cuda_context_bytes=H200.cuda_context_bytes,
        mem_fraction_static=fraction,
        kv_pool_tokens=pools // b.kv_bytes_per_token,
        # weights absorb the rounding so that the idle free memory is exactly what the fraction leaves
        weights_bytes=startup
        - b.cuda_graph_bytes
        - idle_free
        - b.mamba_pool_bytes
        - (pools // b.kv_bytes_per_token) * b.kv_bytes_per_token,
    )


@cache
def profile_for(name: str) -> LaneProfile:
    if name.startswith("h200-qwen3next-"):
        return h200_qwen3next(float(name.rsplit("-", 1)[1]))
    if name == DENSE_H100:
        return dense70b_h100()
    if name == FIXED700:
        # Every prefill step allocates 700 MiB more, whatever its size: a shape no shipped profile has.
        return MAXQ_BOUNDED.replace(name=name, fixed_bytes_per_step=700 * MiB)
    if name == TP2_UNEQUAL:
        # Another process holds 1 GiB more on GPU 0 than on GPU 1 from the start; the per-GPU policy of
        # scenarios/tp/ was written for equal cards and is not told.
        p = get_profile("maxq-bounded-tp2")
        return p.replace(
            name=name, rank_other_process_bytes=(p.other_process_bytes + 1024 * MiB, p.other_process_bytes)
        )
    return get_profile(name)


TP2_UNEQUAL = "maxq-bounded-tp2-unequal"
DENSE_H100 = "dense70b-fp8-h100"
FIXED700 = "maxq-bounded-fixed700"
CALIBRATED = "calibrated-fixed700"


@cache
def calibrated_policy() -> LoadedPolicy:
    """``calibrate`` run on the FIXED700 lane from the shipped bounded-build policy (the emulator's
    probe of the lane, ``probe_lane.calibrate_on_model``, default safety): what an operator would deploy."""
    from sidecar.policy.schema import load_policy_text
    from sidecar_emulator.probe_lane import calibrate_on_model

    text = (ROOT / "policies" / "maxq-qwen3next-bounded.yaml").read_text()
    proposed, _run, result = calibrate_on_model(profile_for(FIXED700), text)
    if proposed is None:
        raise RuntimeError(f"calibrate proposed nothing on {FIXED700}: {result}")
    return load_policy_text(proposed)


def dense70b_h100() -> LaneProfile:
    """A dense 70B-class model in FP8 on one H100 80 GB at ``--mem-fraction-static`` 0.90, 128K context:
    a small KV pool (~33K tokens) that binds long before memory outside it does. Device figures: the
    81,559 MiB H100 of issue 29 with the ``h200`` profile's reserved and context bytes; model figures
    assumed from the architecture (80 layers, 8 KV heads of 128, FP8 KV: 160 KiB per token; ~65.5 GiB of
    FP8 weights; ~176 KiB of live activations per prefill token). No shipped policy describes it."""
    total = 81_559 * MiB
    kv_per_token = 80 * 8 * 128 * 2
    startup = total - H200.device_reserved_bytes - H200.cuda_context_bytes
    weights = 67_120 * MiB
    pools = int(0.90 * startup) - weights
    return H200.replace(
        name=DENSE_H100,
        description="H100 80 GB, dense 70B-class FP8, --mem-fraction-static 0.90, 128K context",
        served_model_name="dense-70b-fp8",
        device_total_bytes=total,
        mem_fraction_static=0.90,
        weights_bytes=weights,
        kv_pool_tokens=pools // kv_per_token,
        kv_bytes_per_token=kv_per_token,
        kv_cache_dtype="fp8_e4m3",
        context_length=131_072,
        max_running_requests=32,
        prefill_tokens_per_s=6_000.0,
        decode_tokens_per_s=30.0,
        activation_bytes_per_token=176 * 1024,
    )


def perturbed(profile: LaneProfile, lag: str, perturbation: str) -> LaneProfile:
    p = profile
    if lag == "laggy":
        p = p.replace(
            decode_log_interval=p.decode_log_interval * SLOW_PUBLISH,
            loads_publish_interval=p.loads_publish_interval * SLOW_PUBLISH,
            idle_publish_s=p.idle_publish_s * SLOW_PUBLISH,
            prefill_publish_every=SLOW_PUBLISH,
        )
    if perturbation == "x1.2":

        def up(x: int) -> int:
            return int(x * 1.2)

        p = p.replace(
            activation_bytes_per_token=up(p.activation_bytes_per_token),
            context_bytes_per_token=up(p.context_bytes_per_token),
            gather_bytes_per_token=up(p.gather_bytes_per_token),
            gather_cap_bytes=None if p.gather_cap_bytes is None else up(p.gather_cap_bytes),
            unknown_extra_bytes=up(p.unknown_extra_bytes),
        )
    elif perturbation.startswith("noise"):
        p = p.replace(transient_noise=int(perturbation[5:]) / 100)
    else:
        p = robust_profile(p, perturbation)
    return p


# The robustness block's engine changes (bench/robustness.py), each a property of the emulated engine
# that the policy is not told: ``round2m`` every allocation rounded up to 2 MiB blocks (PyTorch's
# caching allocator); ``sysX`` transients X times the model from the start; ``lateX`` from LATE_S on (an
# engine change under a running sidecar); ``upgradeX`` a planned restart at LATE_S onto a build whose
# transients are X times larger.
LATE_S = 20.0


def robust_profile(p: LaneProfile, perturbation: str) -> LaneProfile:
    if perturbation == "round2m":
        return p.replace(allocation_round_bytes=2 * MiB)
    for prefix, change in (
        ("sys", lambda x: {"transient_scale": x}),
        ("late", lambda x: {"transient_scale": x, "transient_scale_from_s": LATE_S}),
        ("upgrade", lambda x: {"upgrade_at_s": LATE_S, "upgrade_scale": x}),
    ):
        if perturbation.startswith(prefix):
            return p.replace(**change(float(perturbation[len(prefix) :])))
    if perturbation not in ("none", "neighbour"):
        raise ValueError(f"unknown perturbation {perturbation!r}")
    return p


def single_request_limit(profile: LaneProfile, max_new: int) -> int:
    """The longest cold prompt an idle engine survives (prefill and first decode step), by bisection."""
    oracle = bl.Oracle(profile)
    lo, hi = 1_000, profile.max_req_input_len - 1
    if oracle.alone(hi, max_new) == "served":
        return hi
    while hi - lo > 512:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if oracle.alone(mid, max_new) == "served" else (lo, mid)
    return lo


# ------------------------------------------------------------------------------------------ scenarios
def _family(name: str, seed: int) -> Scenario:
    """The scenario families no policy was written for; ``seed`` draws their arrivals and lengths."""
    rng = random.Random(f"{name}/{seed}")
    if name == "band-below-limit":
        limit = single_request_limit(get_profile("maxq-old"), 1024)
        t, reqs = 0.0, []
        for _ in range(8):
            reqs.append(
                Request(
                    t=round(t, 3), prompt_tokens=int(limit * rng.uniform(0.90, 0.995)), max_new_tokens=1024
                )
            )
            t += rng.expovariate(1 / 20)
        return Scenario(
            name=name,
            description=f"8 cold requests at 90-99.5 % of the old Max-Q lane's true single-request limit ({limit:,} tokens)",
            profile="maxq-old",
            policy="sidecar_emulator/policies/maxq-qwen3next-old.yaml",
            seed=seed,
            duration_s=1800,
            workload=[Requests(kind="requests", requests=reqs, retries=2)],
        )
    if name == "two-cached-agents":
        return Scenario(
            name=name,
            description="Two agents with ~200K and ~170K cached histories taking turns on the old Max-Q lane",
            profile="maxq-old",
            policy="sidecar_emulator/policies/maxq-qwen3next-old.yaml",
            seed=seed,
            duration_s=1800,
            workload=[
                Agents(
                    kind="agents",
                    name="a",
                    history_tokens=int(200_000 * rng.uniform(0.95, 1.05)),
                    turn_tokens=3000,
                    output_tokens=1000,
                    turns=10,
                    think_s=3,
                ),
                Agents(
                    kind="agents",
                    name="b",
                    history_tokens=int(170_000 * rng.uniform(0.95, 1.05)),
                    turn_tokens=3000,
                    output_tokens=1000,
                    turns=10,
                    think_s=3,
                    start_s=rng.uniform(0, 3),
                ),
            ],
        )
    if name.startswith("h200-qwen3next-"):
        t, chat = 0.0, []
        while t < 420:
            chat.append(
                Request(
                    t=round(t, 3), prompt_tokens=rng.randint(1_000, 8_000), max_new_tokens=256, priority=10
                )
            )
            t += rng.expovariate(1 / 4)
        return Scenario(
            name=name,
            description="H200 + Qwen3-Next-class lane (no shipped policy): two agents growing to ~400K, short chat at a higher priority",
            profile=name,
            policy="sidecar_emulator/policies/h200-generic.yaml",
            seed=seed,
            duration_s=2400,
            workload=[
                Agents(
                    kind="agents",
                    name="agent",
                    count=2,
                    history_tokens=int(150_000 * rng.uniform(0.95, 1.05)),
                    turn_tokens=30_000,
                    output_tokens=2000,
                    turns=9,
                    think_s=5,
                    stagger_s=rng.uniform(1, 10),
                ),
                Requests(kind="requests", requests=chat, retries=2),
            ],
        )
    if name == "samples-n4":
        reqs = []
        t = 0.0
        for _ in range(10):
            reqs.append(
                Request(
                    t=round(t, 3), prompt_tokens=rng.randint(20_000, 120_000), max_new_tokens=512, samples=4
                )
            )
            t += rng.expovariate(1 / 15)
        return Scenario(
            name=name,
            description="10 requests of 20K-120K tokens, each with n = 4 parallel samples, on the Mamba lane",
            profile="mamba-lane",
            policy="policies/mamba-lane.yaml",
            seed=seed,
            duration_s=1800,
            workload=[Requests(kind="requests", requests=reqs, retries=3)],
        )
    if name == "dense-small-pool":
        t, reqs = 0.0, []
        while t < 150:
            reqs.append(Request(t=round(t, 3), prompt_tokens=rng.randint(1_000, 28_000), max_new_tokens=512))
            t += rng.expovariate(1 / 4)
        return Scenario(
            name=name,
            description="Requests of 1K-28K tokens every ~4 s on a dense 70B FP8 lane with a ~33K-token pool",
            profile=DENSE_H100,
            policy="policies/h200-generic.yaml",
            seed=seed,
            duration_s=1800,
            workload=[Requests(kind="requests", requests=reqs, retries=2)],
        )
    if name == CALIBRATED:
        base = jittered(load_scenario(ROOT / "scenarios" / "agents-with-subagents.yaml"), seed)
        return base.model_copy(
            update={
                "name": name,
                "description": "agents-with-subagents on a lane that allocates 700 MiB per prefill step more, "
                "served with the policy calibrate proposed there",
                "profile": FIXED700,
            }
        )
    if name == "tp2-unequal":
        base = load_scenario(ROOT / "scenarios" / "tp" / "tp2-neighbour.yaml")
        return base.model_copy(
            update={
                "name": name,
                "description": "TP2 lane, 1 GiB more neighbour on GPU 0 from the start, GPU 1's neighbour grows 2 GiB from 20 s to 140 s",
                "profile": TP2_UNEQUAL,
                "seed": seed,
                "gpu_events": [
                    GpuEvent(t=20, other_process_bytes=(676 + 2048) * MiB, gpu=1),
                    GpuEvent(t=140, other_process_bytes=676 * MiB, gpu=1),
                ],
            }
        )
    raise KeyError(name)


# Scenarios of the robustness block only (bench/robustness.py), not of the study.
ROBUSTNESS_FAMILIES = ["samples-n4", "tp2-unequal", "dense-small-pool", CALIBRATED]
FAMILIES = ["band-below-limit", "two-cached-agents", "h200-qwen3next-0.90", "h200-qwen3next-0.98"]


def shipped_names() -> list[str]:
    return sorted(p.stem for p in (ROOT / "scenarios").glob("*.yaml"))


def jittered(sc: Scenario, index: int) -> Scenario:
    """Seed index 0 is the scenario as shipped; later ones move arrivals and scale lengths a little."""
    if index == 0:
        return sc
    rng = random.Random(f"{sc.name}/{index}")
    work: list[Any] = []
    for w in sc.workload:
        if isinstance(w, Agents):
            w = w.model_copy(
                update={
                    "history_tokens": int(w.history_tokens * rng.uniform(0.95, 1.05)),
                    "turn_tokens": max(1, int(w.turn_tokens * rng.uniform(0.9, 1.1))),
                    "start_s": w.start_s + rng.uniform(0, 3),
                }
            )
        elif isinstance(w, Burst):
            w = w.model_copy(
                update={
                    "start_s": w.start_s + rng.uniform(0, 2),
                    "interval_s": w.interval_s * rng.uniform(0.8, 1.2),
                }
            )
        elif isinstance(w, Rounds):
            w = w.model_copy(update={"start_s": w.start_s + rng.uniform(0, 2)})
        work.append(w)
    return sc.model_copy(update={"workload": work, "seed": sc.seed + index})


@cache
def scenario(name: str, index: int) -> Scenario:
    if name in FAMILIES or name in ROBUSTNESS_FAMILIES:
        return _family(name, index)
    return jittered(load_scenario(ROOT / "scenarios" / f"{name}.yaml"), index)


# Where the emulator-exact policies live, and the lane policies of the same names (issue 29, item 4).
EMULATOR_POLICIES = ROOT / "sidecar_emulator" / "policies"
LANE_POLICIES = ROOT / "policies"


@cache
def policy_for(name: str, lane: bool = False) -> LoadedPolicy:
    """The scenario's policy; ``lane``: the lane policy in ``policies/`` of the same name where the
    scenario names an emulator-exact one (what an operator deploys: the robustness block runs it)."""
    if name == CALIBRATED:
        return calibrated_policy()
    sc = scenario(name, 0)
    path = sc.policy_path(ROOT / "scenarios")
    if lane and path.resolve().parent == EMULATOR_POLICIES:
        path = LANE_POLICIES / path.name
    return load_policy_file(path)


def with_overrides(loaded: LoadedPolicy, overrides: tuple[tuple[str, str], ...]) -> LoadedPolicy:
    """The policy with ``--policy-set`` fields changed (``("cost.margin", "1.05")``: a what-if run),
    validated as a policy file's fields are (sizes such as ``64MiB``, bounds, unknown fields refused).
    Raises ``ValueError`` naming the field."""
    if not overrides:
        return loaded
    data = loaded.policy.model_dump()
    for key, text in overrides:
        *path, field = key.split(".")
        node = data
        for part in path:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"{key}: no policy section {part!r}")
            node = node[part]
        if field not in node:
            close = suggest(field, list(node))
            meant = f"; did you mean {close!r}?" if close else ""
            raise ValueError(f"{key}: no field {field!r} in {'.'.join(path) or 'the policy'}{meant}")
        node[field] = yaml.safe_load(text)
    try:
        policy = Policy.model_validate(data)
    except ValidationError as e:
        said = [humane(x, Policy) for x in e.errors()]  # type: ignore[arg-type]
        raise ValueError("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in said)) from None
    return LoadedPolicy(policy, loaded.sha256, loaded.path)


# ------------------------------------------------------------------------------------------ gates
def sweep_values(gate: str, profile: LaneProfile, quick: bool) -> list[int]:
    ctx = profile.context_length
    if gate == "static-cap":
        return [1, 2, 4] if quick else [1, 2, 3, 4, 6, 8, 16]
    if gate == "token-budget":
        fr = [0.5, 1.0, 2.0] if quick else [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]
    else:
        fr = [0.4, 0.6, 0.8, 1.0] if quick else [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    return [int(ctx * f) for f in fr]


def make_gate(gate: str, value: int | None, profile: LaneProfile, lag: str) -> bl.Gate:
    slow = lag == "laggy"
    if gate == "none":
        return bl.NoGate()
    if gate == "static-cap":
        return bl.StaticCap(int(value or 1))
    if gate == "token-budget":
        return bl.TokenBudget(int(value or 0))
    if gate == "max-length":
        return bl.MaxLength(int(value or 0))
    if gate == "gie-saturation":
        return bl.GieSaturation(poll_interval_s=SLOW_POLL_S if slow else 0.05)
    if gate == "smg-overload":
        return bl.SmgOverload(poll_interval_s=SLOW_POLL_S if slow else 1.0)
    if gate == "oracle":
        return bl.Oracle(profile)
    raise KeyError(gate)


def slow_policy(policy: LoadedPolicy) -> LoadedPolicy:
    """Polled every 5 s and never sooner (no reads after an end: ``engine.poll_after_release_s`` 0);
    signals count as fresh for two polls (a 5 s age limit would hold everything)."""
    p = policy.policy
    policy = policy.with_section(
        "engine",
        poll_interval_s=SLOW_POLL_S,
        max_age_s=max(p.engine.max_age_s, 2 * SLOW_POLL_S + 0.5),
        poll_after_release_s=0,
    )
    return policy.with_section(
        "gpu", poll_interval_s=SLOW_POLL_S, max_age_s=max(p.gpu.max_age_s, 2 * SLOW_POLL_S + 0.5)
    )


# ------------------------------------------------------------------------------------------ one run
@dataclass(frozen=True)
class Task:
    scenario: str
    index: int
    lag: str
    perturbation: str
    gate: str
    value: int | None = None
    # --policy-set: the sidecar's policy changed for a what-if run
    overrides: tuple[tuple[str, str], ...] = ()
    # The lane policy (``policies/``) instead of the scenario's emulator-exact one (``policy_for``).
    lane_policy: bool = False


def run_task(task: Task) -> dict[str, Any]:
    sc = scenario(task.scenario, task.index)
    profile = perturbed(profile_for(sc.profile), task.lag, task.perturbation)
    seed = sc.seed
    started = time.perf_counter()
    driver: Driver
    if task.gate == "sidecar":
        policy = with_overrides(policy_for(task.scenario, task.lane_policy), task.overrides)
        if task.lag == "laggy":
            policy = slow_policy(policy)
        driver = bl.SidecarDriver(sc, profile, policy, seed)
        setting = policy.policy.name + "".join(f" {k}={v}" for k, v in task.overrides)
    else:
        gate = make_gate(task.gate, task.value, profile, task.lag)
        driver = bl.GatedDriver(sc, profile, gate, seed)
        setting = gate.setting
    if task.perturbation == "neighbour":
        driver.neighbour = bl.Neighbour(NEIGHBOUR_BYTES)  # type: ignore[attr-defined]
    r = driver.run()
    held: dict[str, int] = defaultdict(int)
    for k, n in (r.get("decisions") or {}).items():
        action, _, reason = k.partition("/")
        if action == "hold":
            held[reason or "hold"] += n
    return {
        "scenario": task.scenario,
        "profile": profile.name,
        "gate": task.gate,
        "setting": setting,
        "value": task.value,
        "lag": task.lag,
        "perturbation": task.perturbation,
        "seed": seed,
        "crashes": len(r["crashes"]),
        "crash_times": [c["t"] for c in r["crashes"]],
        "crash_reasons": sorted({c["reason"].split(".")[0] for c in r["crashes"]}),
        "downtime_s": r["downtime_s"],
        "requests": r["requests"],
        "completed": r["completed"],
        "failed": r["failed"],
        "served_tokens": r["served_tokens"],
        "span_s": r["span_s"],
        "ttft_p50_s": r["ttft_p50_s"],
        "ttft_p99_s": r["ttft_p99_s"],
        "rejected": r["rejected"],
        "rejected_by_reason": r["rejected_by_reason"],
        # Admitted requests the in-flight guard stopped before their prefill's peak (sidecar only).
        "guard_aborts": r["rejected_by_reason"].get("prefill_overrun", 0),
        "held": sum(held.values()),
        "held_by_reason": dict(held),
        "wall_s": round(time.perf_counter() - started, 3),
    }


# Relative cost of a run (seconds on one core, from a --quick run): the longest go first, so that the
# last minute is not one worker finishing a long run while the others idle. Only the order depends on it.
_SCENARIO_COST = {"sustained-rounds": 30.0, "h200-qwen3next-0.98": 15.0, "h200-qwen3next-0.90": 5.0}
_GATE_COST = {"oracle": 3.0, "sidecar": 2.5}


def _cost(t: Task) -> float:
    return _SCENARIO_COST.get(t.scenario, 1.0) * _GATE_COST.get(t.gate, 1.0)


def run_all(tasks: list[Task], pool: ProcessPoolExecutor | None, desc: str) -> list[dict[str, Any]]:
    """Every task's row, in the order of ``tasks`` whatever the number of workers: each run is a pure
    function of its task (seeded noise, virtual time), so the rows do not depend on ``--jobs``."""
    bar = tqdm(total=len(tasks), desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)
    out: list[dict[str, Any] | None] = [None] * len(tasks)
    if pool is None:
        for i, t in enumerate(tasks):
            out[i] = run_task(t)
            bar.update()
    else:
        order = sorted(range(len(tasks)), key=lambda i: -_cost(tasks[i]))
        futures = {pool.submit(run_task, tasks[i]): i for i in order}
        for f in as_completed(futures):
            out[futures[f]] = f.result()
            bar.update()
    bar.close()
    return [r for r in out if r is not None]


# ------------------------------------------------------------------------------------------ the study
def best_value(rows: list[dict[str, Any]]) -> int | None:
    """Zero crashes on every seed first, then the highest mean goodput (served tokens / span)."""
    by: dict[int | None, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["value"]].append(r)

    def score(v: int | None) -> tuple[int, float]:
        rs = by[v]
        return (-sum(r["crashes"] for r in rs), statistics.mean(r["goodput_tokens_per_s"] for r in rs))

    return max(by, key=score)


def add_goodput(rows: list[dict[str, Any]], oracle_span: dict[tuple, float]) -> None:
    for r in rows:
        span = (
            max(r["span_s"], oracle_span.get((r["scenario"], r["seed"], r["lag"], r["perturbation"]), 0.0))
            or 1.0
        )
        r["goodput_tokens_per_s"] = round(r["served_tokens"] / span, 1)


def _key(r: dict[str, Any]) -> tuple[str, int, str, str]:
    return (r["scenario"], r["seed"], r["lag"], r["perturbation"])


def study(args: argparse.Namespace, pool: ProcessPoolExecutor | None) -> list[dict[str, Any]]:
    names = args.scenarios or (shipped_names() + FAMILIES)
    seeds = range(args.seeds)
    settings = SETTINGS if not args.settings else [s for s in SETTINGS if f"{s[0]}/{s[1]}" in args.settings]
    # The oracle always runs: its span is every other run's floor, its goodput the bound.
    gates = [g for g in GATES if g == "oracle" or not getattr(args, "gates", None) or g in args.gates]
    swept = [g for g in sorted(SWEPT) if g in gates]
    # 1. the oracle everywhere (its span is every other run's floor) and, in the same pass, the sweeps
    #    of the tunable baselines on the default setting
    tasks = [Task(n, i, lag, pert, "oracle") for n in names for i in seeds for lag, pert in settings]
    n_oracle = len(tasks)
    tasks += [
        Task(n, i, "default", "none", g, v)
        for n in names
        for g in swept
        for v in sweep_values(g, profile_for(scenario(n, 0).profile), args.quick)
        for i in seeds
    ]
    first = run_all(tasks, pool, "oracle and sweeps")
    rows, sweep = first[:n_oracle], first[n_oracle:]
    oracle_span = {_key(r): r["span_s"] for r in rows}
    add_goodput(rows, oracle_span)
    add_goodput(sweep, oracle_span)
    best: dict[tuple[str, str], int | None] = {}
    for n in names:
        for g in swept:
            best[(n, g)] = best_value([r for r in sweep if r["scenario"] == n and r["gate"] == g])
    for r in sweep:
        r["sweep"] = True
        r["best"] = best[(r["scenario"], r["gate"])] == r["value"]
    # 2. every gate (swept ones at their best) on every setting
    tasks = []
    for n in names:
        for g in gates:
            if g == "oracle":
                continue
            for lag, pert in settings:
                if g in SWEPT and (lag, pert) == ("default", "none"):
                    continue  # the sweep already ran it
                for i in seeds:
                    tasks.append(Task(n, i, lag, pert, g, best.get((n, g)), _overrides(args, g)))
    rest = run_all(tasks, pool, "gates")
    add_goodput(rest, oracle_span)
    for r in rest:
        r["best"] = True  # swept baselines run the robustness settings at their best setting only
    rows = rows + rest + sweep
    add_envelope(rows)
    for r in rows:
        r.setdefault("sweep", False)
        r.setdefault("best", r["gate"] not in SWEPT)
        r["crash_check"] = False
    return rows + zero_crash_check(args, names, settings, pool)


def _overrides(args: argparse.Namespace, gate: str) -> tuple[tuple[str, str], ...]:
    """``--policy-set KEY=VALUE`` pairs, for the sidecar's tasks only."""
    if gate != "sidecar":
        return ()
    return tuple(tuple(kv.split("=", 1)) for kv in getattr(args, "policy_set", None) or ())  # type: ignore[misc]


def _quiet() -> None:
    """Thousands of virtual lanes run here: the sidecar's own warnings (a monitor finding in every run
    under x1.2 or noise, say) would bury the progress bar and the tables, and what they say is in the
    rows. Errors still show."""
    logging.getLogger("sidecar").setLevel(logging.ERROR)


def zero_crash_check(
    args: argparse.Namespace,
    names: list[str],
    settings: list[tuple[str, str]],
    pool: ProcessPoolExecutor | None,
) -> list[dict[str, Any]]:
    """The sidecar alone on the seeds past the tables' (``--crash-seeds``), every scenario and setting.

    Why: "zero crashes on every seed" over three seeds says little about a gate whose margin does not
    cover a perturbation, where a crash needs an unlucky draw on one request at the edge of its policy
    (the band family under noise crashed 1 and 5 times in 20 seeds, none in the first three, until the
    monitor judged readings by the prefills' progress now: evidence D17). These
    rows count crashes only: no oracle ran on their seeds, so their goodput is over their own span and
    is compared with nothing, and the tables leave them out (``crash_check``)."""
    extra = range(args.seeds, getattr(args, "crash_seeds", 0) or 0)
    if not extra or (getattr(args, "gates", None) and "sidecar" not in args.gates):
        return []
    ov = _overrides(args, "sidecar")
    tasks = [
        Task(n, i, lag, pert, "sidecar", None, ov) for n in names for i in extra for lag, pert in settings
    ]
    rows = run_all(tasks, pool, "zero-crash check")
    add_goodput(rows, {})
    for r in rows:
        r.update(
            crash_check=True,
            sweep=False,
            best=False,
            goodput_vs_oracle=None,
            oracle_goodput_tokens_per_s=None,
            bound_goodput_tokens_per_s=None,
            bound_gate="",
        )
    return rows


def add_envelope(rows: list[dict[str, Any]]) -> None:
    """The bound each run is measured against: the best goodput of any run WITHOUT a crash on the same
    scenario, seed and setting, the oracle's included.

    The oracle admits greedily, one request at a time, on the state it sees: it cannot see the future
    (the noise of later steps, the neighbour that grows when it admits, whether holding one request a
    little longer would let the burst finish sooner). A baseline can therefore beat it on a setting;
    the envelope keeps "vs oracle" an upper-bound comparison (<= 100 % for every crash-free run).
    ``oracle_goodput_tokens_per_s`` keeps the oracle run's own figure, ``bound_gate`` names the gate
    that set the bound.
    """
    oracle = {_key(r): r["goodput_tokens_per_s"] for r in rows if r["gate"] == "oracle"}
    bound: dict[tuple[str, int, str, str], tuple[float, str]] = {k: (v, "oracle") for k, v in oracle.items()}
    for r in rows:
        k = _key(r)
        if r["crashes"] == 0 and r["goodput_tokens_per_s"] > bound.get(k, (0.0, ""))[0]:
            bound[k] = (r["goodput_tokens_per_s"], r["gate"])
    for r in rows:
        k = _key(r)
        b, by = bound.get(k, (0.0, ""))
        r["oracle_goodput_tokens_per_s"] = oracle.get(k)
        r["bound_goodput_tokens_per_s"] = b
        r["bound_gate"] = by
        r["goodput_vs_oracle"] = round(r["goodput_tokens_per_s"] / b, 4) if b else None


# ------------------------------------------------------------------------------------------ fidelity
def fidelity() -> list[tuple[str, str, str]]:
    """The incident's figures against what the emulator does on the shipped scenarios (seed as shipped)."""
    out: list[tuple[str, str, str]] = []
    sc = load_scenario(ROOT / "scenarios" / "maxq-outage-burst.yaml")
    d = Driver(sc, get_profile(sc.profile), None, sc.seed)
    d.run()
    c = d.engine.crashes[0] if d.engine.crashes else None
    if c is None:
        out.append(("outage: crash", "yes", "NO CRASH"))
    else:
        g = c.live
        out += [
            ("outage: failed allocation", "560 MiB", f"{(c.requested_bytes or 0) / MiB:.0f} MiB"),
            (
                "outage: free at the failure",
                "280.94 MiB",
                f"{(c.free_bytes or 0) / MiB:.0f} MiB (miss: evidence D11)",
            ),
            ("outage: running / queued", "1 / 14", f"{g.num_running_reqs} / {g.num_queue_reqs}"),
            (
                "outage: pending prefill tokens",
                "1,485,849",
                f"{g.pending_prefill_tokens:,} ({g.pending_prefill_tokens / 1_485_849 - 1:+.1%})",
            ),
            (
                "outage: token usage / Mamba usage",
                "0.73 / 0.06",
                f"{g.token_usage:.2f} / {g.mamba_usage:.2f}",
            ),
        ]
    model = EngineModel(get_profile("mamba-lane"))
    for i in range(3):
        model.submit(f"cold-{i}", 140_000, max_new_tokens=2048, now=0.0)
    seq: list[float] = []
    while model.up and model.next_event_time() is not None:
        model.advance(model.next_event_time())  # type: ignore[arg-type]
        g = model.published_gauges()
        if g is not None and (not seq or seq[-1] != round(g.mamba_usage, 2)):
            seq.append(round(g.mamba_usage, 2))
    mc = model.crashes[0] if model.crashes else None
    # The last published figure, then the engine's true state at the failed allocation (its last report).
    last = seq[-1] if seq else None
    at_crash = round(mc.live.mamba_usage, 2) if mc is not None else None
    jumped = last is not None and last < 0.5 and at_crash == 1.0
    note = ""
    if jumped and last != 0.18:
        note = " (jump met; 0.24 = 3 x 4 working slots of 51: evidence D13)"
    elif not jumped:
        note = " (miss: climbs)"
    out.append(
        (
            "mamba lane: Mamba usage, last report -> at the failed allocation",
            "0.18 -> 1.00",
            (f"{last:.2f}" if last is not None else "-")
            + " -> "
            + (f"{at_crash:.2f}" if at_crash is not None else "no crash")
            + note,
        )
    )
    if mc is not None:
        out.append(
            (
                "mamba lane: running, full usage at the crash",
                "2, 0.46",
                f"{mc.live.num_running_reqs}, {mc.live.full_token_usage:.2f}",
            )
        )
    sc = load_scenario(ROOT / "scenarios" / "sustained-rounds.yaml")
    r = Driver(sc, get_profile(sc.profile), None, sc.seed).run()
    rounds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for q in r["requests_detail"]:
        rounds[q["rid"].split("-")[0]].append(q)
    took = [max(q["end"] for q in v) - min(q["arrival"] for q in v) for v in rounds.values()]
    out.append(("sustained: seconds a round", "93-107", f"{min(took):.0f}-{max(took):.0f}"))
    peak = max(x for x in r["series"]["full_usage"] if x is not None)
    out.append(
        ("sustained: pool occupancy peak", "57 %", f"{peak:.0%} (miss: two 240K requests run together here)")
    )
    return out


# ------------------------------------------------------------------------------------------ report
def _mean(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.mean(v) if v else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per scenario and gate (best setting): default-setting figures and crashes per robustness setting."""
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        if not r["best"]:
            continue
        cell = out[r["scenario"]].setdefault(r["gate"], {"setting": r["setting"], "by": defaultdict(list)})
        cell["by"][f"{r['lag']}/{r['perturbation']}"].append(r)
    for sc in out.values():
        for cell in sc.values():
            d = cell["by"].get("default/none", [])
            cell["crashes"] = sum(r["crashes"] for r in d)
            cell["vs_oracle"] = _mean([r["goodput_vs_oracle"] for r in d])
            cell["goodput"] = _mean([r["goodput_tokens_per_s"] for r in d])
            cell["ttft_p99"] = _mean([r["ttft_p99_s"] for r in d])
            cell["completed"] = sum(r["completed"] for r in d)
            cell["rejected"] = sum(r["rejected"] for r in d)
            cell["held"] = sum(r["held"] for r in d)
            cell["robust"] = {
                k: (sum(r["crashes"] for r in v), _mean([r["goodput_vs_oracle"] for r in v]))
                for k, v in cell["by"].items()
            }
            cell["all_crashes"] = sum(c for c, _ in cell["robust"].values())
    return out


def largest_admitted_prompt(name: str, max_new: int, below: int | None = None) -> int:
    """The longest cold prompt the scenario's policy does not refuse as unfit (``unfit_request``), on
    an idle lane, by the decision itself. Without ``below``: priced with a full last chunk at the whole
    context (a gate that cannot see the engine's prefill counters), by bisection. With it: the longest
    one below ``below`` that a gate seeing the counters admits when it starts its own prefill batch,
    priced by its own chunk schedule, which depends on where its last chunk falls (not monotone in the
    length: scanned down from ``below``)."""
    from sidecar.core import demand
    from sidecar.core.decide import Situation, decide
    from sidecar.core.decision import Reason
    from sidecar.core.ledger import LedgerTotals
    from sidecar.core.snapshot import Snapshot
    from sidecar.policy.in_force import rules_of

    rules = rules_of(policy_for(name).policy)
    situation = Situation(rules, Snapshot(), LedgerTotals(), 0.0, verifies_hits=below is not None)

    def fits(n: int) -> bool:
        d = demand.build(rules, n, arrived_at=0.0, max_new_tokens=max_new)
        return decide(d, situation).reason is not Reason.UNFIT_REQUEST

    if below is not None:
        return next((n for n in range(below, 0, -1) if fits(n)), 0)
    lo, hi = 1, rules.lane.context_len - max_new
    if fits(hi):
        return hi
    while hi - lo > 64:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _max_new_tokens(sc: Scenario) -> int:
    """The largest output any request of the scenario asks for (what an unfit verdict was judged with)."""
    out = [1]
    for w in sc.workload:
        if isinstance(w, Requests):
            out += [q.max_new_tokens for q in w.requests]
        for field in ("max_new_tokens", "output_tokens"):
            value = getattr(w, field, None)
            if isinstance(value, int):
                out.append(value)
    return max(out)


def why_short(name: str, gates: dict[str, dict[str, Any]]) -> list[str]:
    """What the sidecar's own runs say held it back on the default setting: its refusals and holds by
    reason, its span against the best crash-free baseline's, and where it refused requests as unfit,
    the longest prompt its policy admits against the lane's true single-request limit."""
    s = gates["sidecar"]
    runs = s["by"].get("default/none", [])
    rejected: dict[str, int] = defaultdict(int)
    held: dict[str, int] = defaultdict(int)
    for r in runs:
        for k, n in r["rejected_by_reason"].items():
            rejected[k] += n
        for k, n in r["held_by_reason"].items():
            held[k] += n
    out = []
    if rejected:
        out.append("rejected " + ", ".join(f"{k} {n}" for k, n in sorted(rejected.items())))
    if held:
        out.append("held " + ", ".join(f"{k} {n}" for k, n in sorted(held.items())))
    rivals = [(g, c) for g, c in gates.items() if g not in ("sidecar", "oracle") and c["crashes"] == 0]
    if rivals and runs:
        g, c = max(rivals, key=lambda gc: gc[1]["goodput"] or 0)
        span = _mean([r["span_s"] for r in runs]) or 0.0
        rival = _mean([r["span_s"] for r in c["by"]["default/none"]]) or 0.0
        out.append(f"span {span:,.1f} s against {g}'s {rival:,.1f} s")
    if rejected.get("unfit_request") and runs:
        profile = profile_for(scenario(name, 0).profile)
        max_new = _max_new_tokens(scenario(name, 0))
        true = single_request_limit(profile, max_new)
        mine = largest_admitted_prompt(name, max_new)
        alone = largest_admitted_prompt(name, max_new, below=true)
        p = policy_for(name).policy
        out.append(
            f"the policy admits cold prompts up to {mine:,} tokens, {mine / true:.1%} of the lane's true "
            f"single-request limit ({true:,}), priced with a full last chunk (a shared prefill batch can "
            f"shift the chunks, tests/test_cost_schedule.py), and started alone, priced by their own "
            f"chunk schedule, up to {alone:,} ({alone / true:.1%}) where their last chunk falls best "
            f"(margin {p.cost.margin:g}, reserve {p.vram.reserve_bytes / 2**20:g} MiB)"
        )
    return out


def checked_crashes(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """The zero-crash check's crashed seeds, per scenario and setting (every scenario it ran is a key)."""
    out: dict[str, dict[str, list[int]]] = {}
    for r in rows:
        if r.get("crash_check"):
            by = out.setdefault(r["scenario"], {})
            if r["crashes"]:
                by.setdefault(f"{r['lag']}/{r['perturbation']}", []).append(r["seed"])
    return out


def acceptance(
    summary: dict[str, dict[str, dict[str, Any]]], checked: dict[str, dict[str, list[int]]] | None = None
) -> list[str]:
    lines = []
    for name, gates in summary.items():
        s = gates.get("sidecar")
        if s is None:
            continue
        notes = []
        if s["all_crashes"]:
            bad = [k for k, (c, _) in s["robust"].items() if c]
            notes.append(f"SHORT: {s['all_crashes']} crash(es) ({', '.join(bad)})")
        more = (checked or {}).get(name, {})
        if more:
            n = sum(len(v) for v in more.values())
            order = [f"{lag}/{p}" for lag, p in SETTINGS]
            more = dict(
                sorted(more.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
            )
            where = "; ".join(
                f"{k} seed{'s' if len(v) > 1 else ''} {', '.join(map(str, sorted(v)))}"
                for k, v in more.items()
            )
            notes.append(f"SHORT: {n} crash{'es' if n > 1 else ''} in the zero-crash check ({where})")
        if s["vs_oracle"] is not None and s["vs_oracle"] < 0.95:
            notes.append(f"SHORT: {s['vs_oracle']:.0%} of oracle goodput (< 95 %)")
        # "Every baseline that also had zero crashes on that scenario": the same bar as the sidecar's,
        # every seed and robustness setting. A baseline that wins on the default setting and crashes off
        # it (tuned there, as the sweep does) is a different trade; it is named, as a note, not a miss.
        above = {
            g: c
            for g, c in gates.items()
            if g not in ("sidecar", "oracle")
            and c["crashes"] == 0
            and (c["goodput"] or 0) > (s["goodput"] or 0) * 1.0001
        }
        better = [g for g, c in above.items() if c["all_crashes"] == 0]
        if better:
            notes.append("SHORT: below zero-crash " + ", ".join(
                f"{g} (by {1 - (s['goodput'] or 0) / gates[g]['goodput']:.2%})" for g in better
            ))  # fmt: skip
        caveats = [
            f"{g}: the sidecar is {1 - (s['goodput'] or 0) / c['goodput']:.2%} below it on the default setting, "
            f"but it crashes {c['all_crashes']} time{'s' if c['all_crashes'] > 1 else ''} off it "
            f"({', '.join(k for k, (n, _) in c['robust'].items() if n)}): not a zero-crash rival"
            for g, c in above.items()
            if c["all_crashes"]
        ]
        vs = "-" if s["vs_oracle"] is None else f"{s['vs_oracle']:.0%}"
        lines.append(
            f"  {name:24s} " + ("; ".join(notes) if notes else f"meets the targets ({vs} of oracle)")
        )
        lines += [f"  {'':24s}   note: {c}" for c in caveats]
        if notes or caveats:
            lines += [f"  {'':24s}   why: {w}" for w in why_short(name, gates)]
    return lines


def format_tables(rows: list[dict[str, Any]], fid: list[tuple[str, str, str]]) -> str:
    summary = summarise(rows)
    keys = [f"{lag}/{p}" for lag, p in SETTINGS]
    keys = [k for k in keys if any(k in c["robust"] for g in summary.values() for c in g.values())]
    lines = ["Emulator fidelity (incident figure vs the emulator on the shipped scenarios)", ""]
    w = max(len(f) for f, _, _ in fid) + 2
    lines += [f"  {f:{w}s}{a:>16s}   {b}" for f, a, b in fid]
    lines += [
        "",
        "Default setting (mean over seeds; swept baselines at their best setting). 'vs oracle': goodput over",
        "the best crash-free run on the same scenario, seed and setting, the oracle's included (the oracle",
        "admits greedily and cannot see the future, so a baseline may beat it: then that run is the bound)",
        "",
    ]
    head = f"  {'scenario':24s}{'gate':16s}{'setting':30s}{'crashes':>8s}{'completed':>10s}{'goodput':>10s}{'vs oracle':>10s}{'TTFT p99':>10s}{'rejected':>9s}{'held':>6s}"
    lines.append(head)
    for name, gates in summary.items():
        for g in GATES:
            c = gates.get(g)
            if c is None:
                continue
            vs = "-" if c["vs_oracle"] is None else f"{c['vs_oracle']:.0%}"
            ttft = "-" if c["ttft_p99"] is None else f"{c['ttft_p99']:.1f} s"
            lines.append(
                f"  {name:24s}{g:16s}{c['setting'][:29]:30s}{c['crashes']:>8d}{c['completed']:>10d}{(c['goodput'] or 0):>10,.0f}{vs:>10s}{ttft:>10s}{c['rejected']:>9d}{c['held']:>6d}"
            )
        lines.append("")
    lines += ["Robustness: crashes / goodput vs oracle, per setting (all seeds)", ""]
    lines.append(f"  {'scenario':24s}{'gate':16s}" + "".join(f"{k:>18s}" for k in keys))
    for name, gates in summary.items():
        for g in GATES:
            c = gates.get(g)
            if c is None:
                continue
            cells = []
            for k in keys:
                if k not in c["robust"]:
                    cells.append(f"{'-':>18s}")
                    continue
                n, vs = c["robust"][k]
                cells.append(f"{n:>8d} / {('-' if vs is None else f'{vs:.0%}'):>6s}  ")
            lines.append(f"  {name:24s}{g:16s}" + "".join(cells))
        lines.append("")
    checked = checked_crashes(rows)
    _, n = seed_counts(rows)
    lines += [
        "Acceptance (sidecar: zero crashes on every seed and setting; >= 95 % of oracle; >= every baseline",
        "with zero crashes on every seed and setting of the scenario, the bar the sidecar is held to)",
    ]
    if n:
        lines.append(
            f"The zero-crash check ran the sidecar alone on {n} more seeds of every scenario and setting."
        )
    lines.append("")
    lines += acceptance(summary, checked)
    lines += ["", "Best settings of the swept baselines (zero crashes on every seed first, then goodput)", ""]
    for name, gates in summary.items():
        lines.append(
            f"  {name:24s}" + "   ".join(f"{g}: {gates[g]['setting']}" for g in sorted(SWEPT) if g in gates)
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    summary = summarise(rows)
    checked = checked_crashes(rows)
    names = list(summary)
    gates = [g for g in GATES if any(g in summary[n] for n in names)]
    fig, ax = plt.subplots(figsize=(max(9.0, 2.0 + 1.45 * len(names)), 1.6 + 0.62 * len(gates)), dpi=130)
    cmap = LinearSegmentedColormap.from_list("g", ["#f7f7f7", "#2c7fb8"])
    for y, g in enumerate(gates):
        for x, n in enumerate(names):
            c = summary[n].get(g)
            if c is None:
                continue
            vs = c["vs_oracle"] or 0.0
            ax.add_patch(plt.Rectangle((x, y), 1, 1, color=cmap(min(1.0, vs)), ec="white", lw=2))
            ax.text(
                x + 0.5,
                y + 0.38,
                f"{vs:.0%}",
                ha="center",
                va="center",
                fontsize=10,
                color="black" if vs < 0.7 else "white",
                weight="bold",
            )
            crashes = c["all_crashes"]
            more = sum(len(v) for v in checked.get(n, {}).values()) if g == "sidecar" else 0
            if crashes or more:
                label = " + ".join(
                    (
                        [f"{crashes} crash{'es' if crashes != 1 else ''} ({c['crashes']} default)"]
                        if crashes
                        else []
                    )
                    + ([f"{more} crash{'es' if more != 1 else ''} on further seeds"] if more else [])
                )
                box = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"}
                ax.text(
                    x + 0.5,
                    y + 0.74,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="#d7191c",
                    weight="bold",
                    bbox=box,
                )
            else:
                ax.text(
                    x + 0.5,
                    y + 0.74,
                    "no crash",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if vs < 0.7 else "white",
                )
            if crashes or more:
                ax.add_patch(plt.Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, fill=False, ec="#d7191c", lw=2))
    ax.set_xlim(0, len(names))
    ax.set_ylim(len(gates), 0)
    ax.set_xticks([i + 0.5 for i in range(len(names))], [n.replace("-", "-\n", 1) for n in names], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(gates))], gates, fontsize=9)
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.set_title(title, fontsize=10, loc="left")
    fig.text(
        0.01,
        0.01,
        "cell: goodput as % of the oracle's (the best crash-free run on the same seed, the oracle's included; default setting, mean over seeds)\n"
        "red: crashes over all seeds and robustness settings (slow signals, transients x1.2, 5/10 % noise, neighbour)"
        + ("; the sidecar's also over the zero-crash check's further seeds" if checked else ""),
        fontsize=7.5,
        color="#555",
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def seed_counts(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(the tables' seeds, the zero-crash check's further seeds), read from the rows (a saved run
    redrawn with ``--from-json`` has no arguments to ask), the most any scenario ran."""
    tables: dict[str, set[int]] = defaultdict(set)
    more: dict[str, set[int]] = defaultdict(set)
    for r in rows:
        (more if r.get("crash_check") else tables)[r["scenario"]].add(r["seed"])
    return max(map(len, tables.values()), default=0), max(map(len, more.values()), default=0)


def _title(rows: list[dict[str, Any]]) -> str:
    seeds, further = seed_counts(rows)
    settings = len({(r["lag"], r["perturbation"]) for r in rows})
    more = f"; sidecar crashes over {seeds + further} seeds" if further else ""
    return f"Admission quality by gate and scenario ({seeds} seed(s), {settings} settings{more})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=(
            "Settings: default; laggy (signals every 5 s, engine publishing 10x less); x1.2 (every "
            "transient term); noise5 / noise10 (each transient piece times a seeded factor uniform in "
            "[0.95, 1.05] / [0.90, 1.10]: bounded, see the module docstring); neighbour (another "
            "process grows 256 MiB at the instant a held request is admitted)."
        ),
    )
    ap.add_argument("--quick", action="store_true", help="1 seed, short sweeps (under three minutes)")
    ap.add_argument("--seeds", type=int, help="seeds per scenario (default 3; --quick: 1)")
    ap.add_argument(
        "--scenarios", nargs="*", help=f"subset (default: every shipped scenario and {', '.join(FAMILIES)})"
    )
    ap.add_argument("--settings", nargs="*", help="subset of lag/perturbation, e.g. default/none laggy/none")
    ap.add_argument(
        "--crash-seeds",
        type=int,
        metavar="N",
        help="also run the sidecar alone on seeds up to N, every scenario and setting, and count their "
        "crashes in the acceptance (goodput is not compared there: no oracle runs on them); default 20, "
        "none with --quick",
    )
    ap.add_argument(
        "--policy-set",
        action="append",
        metavar="KEY=VALUE",
        help="change a field of the sidecar's policy on every scenario, for a what-if run (repeatable), "
        "e.g. --policy-set cost.margin=1.05 --policy-set vram.reserve_bytes=64MiB",
    )
    ap.add_argument(
        "--gates",
        nargs="*",
        choices=GATES,
        metavar="GATE",
        help=f"subset of gates ({', '.join(GATES)}; the oracle always runs: it is every run's bound), e.g. "
        "--gates sidecar "
        "--seeds 20 to test zero crashes on more seeds than the full run's three",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="worker processes (default: the cores this process may use); the rows do not depend on it",
    )
    ap.add_argument(
        "--json", type=Path, default=RESULTS / "admission.json", help="the rows (default: %(default)s)"
    )
    ap.add_argument(
        "--png",
        type=Path,
        help="the plot (default: beside --json, with .png: a what-if run written elsewhere does not "
        "overwrite the committed plot)",
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--no-robustness", action="store_true", help="skip the robustness block (bench/robustness.py)"
    )
    ap.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="print the tables and draw the plot from a saved run's rows instead of running",
    )
    args = ap.parse_args(argv)
    if args.png is None:
        args.png = (args.from_json or args.json).with_suffix(".png")
    args.seeds = args.seeds or (1 if args.quick else 3)
    if args.crash_seeds is None:
        args.crash_seeds = 0 if args.quick else 20
    known = set(shipped_names() + FAMILIES)
    for n in args.scenarios or []:
        if n not in known:
            ap.error(f"unknown scenario {n!r}; known: {', '.join(sorted(known))}")
    for kv in args.policy_set or []:
        if "=" not in kv:
            ap.error(f"--policy-set {kv!r}: expected KEY=VALUE, e.g. cost.margin=1.05")
    try:
        for n in args.scenarios or (shipped_names() + FAMILIES):
            with_overrides(policy_for(n), _overrides(args, "sidecar"))
    except ValueError as e:
        ap.error(f"--policy-set: {e}")
    if args.from_json is not None:
        rows = json.loads(args.from_json.read_text())
        print(format_tables(rows, fidelity()))
        if not args.no_plot:
            plot(rows, args.png, _title(rows))
            print(f"wrote {args.png}")
        return 0
    started = time.perf_counter()
    fid = fidelity()
    _quiet()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, initializer=_quiet) as pool:
            rows = study(args, pool)
    else:
        rows = study(args, None)
    took = time.perf_counter() - started
    print(format_tables(rows, fid))
    check = (
        f", the sidecar on {args.crash_seeds} for the zero-crash check"
        if args.crash_seeds > args.seeds
        else ""
    )
    print(f"\n{len(rows)} runs in {took:.0f} s ({args.seeds} seed(s){check}, jobs {args.jobs})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.json}")
    if not args.no_plot:
        plot(rows, args.png, _title(rows))
        print(f"wrote {args.png}")
    if args.no_robustness:
        return 0
    import robustness  # bench/robustness.py: imports this module, so only here

    text, ok, robust_rows = robustness.run(robustness.SCENARIOS, args.seeds, args.jobs)
    print("\n" + text)
    args.json.with_name(args.json.stem + "-robustness.json").write_text(
        json.dumps(robust_rows, indent=1, sort_keys=True) + "\n"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
