"""calibrate's proposal: the lane's policy rewritten for the lane that was measured, its comments kept.

The proposal is the starting policy's text, edited line by line (a YAML dump would drop every comment,
and the comments are where each figure says where it comes from): the ``cost:`` section is replaced by
the fit, one short comment per field; ``vram.idle_free_bytes`` and ``vram.reserve_bytes`` become the
measured figures in MiB; the ``lane:`` section, ``name`` and ``description`` come from what the engine
reports (``/server_info``) and the GPU source, when the caller has them (:class:`LaneFacts`). Every
other line, comment or not, is kept as it was.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass

from sidecar.calibrate.fit import MIN_RESERVE, Fit, ProbeRun, proposed_cost

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class LaneFacts:
    """What the engine (``/server_info``, ``/metrics``) and the GPU source said about the lane."""

    context_len: int
    chunked_prefill_size: int
    kv_pool_tokens: int | None = None
    max_running_requests: int | None = None
    mamba_slots: int | None = None
    model: str | None = None
    mem_fraction_static: float | None = None
    engine_version: str | None = None
    gpu: str | None = None  # the device as the GPU source names it (NVML UUID, file path)
    gpu_total_bytes: int | None = None


def lane_name(facts: LaneFacts) -> str:
    """A policy name for the measured lane: the model's last path part and the context, lower case."""
    model = (facts.model or "lane").rstrip("/").rsplit("/", 1)[-1]
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "lane"
    return f"{slug}-{facts.context_len // 1024}k"


def lane_description(facts: LaneFacts, when: str) -> str:
    parts = []
    if facts.gpu_total_bytes:
        parts.append(f"GPU {facts.gpu or '?'} ({facts.gpu_total_bytes // MiB:,} MiB)")
    parts.append(facts.model or "model not reported")
    if facts.mem_fraction_static is not None:
        parts.append(f"--mem-fraction-static {facts.mem_fraction_static:g}")
    parts.append(f"context {facts.context_len:,}")
    parts.append(f"{facts.chunked_prefill_size:,}-token chunks")
    if facts.kv_pool_tokens:
        parts.append(f"KV pool {facts.kv_pool_tokens:,} tokens")
    if facts.mamba_slots:
        parts.append(f"{facts.mamba_slots:,} Mamba slots")
    if facts.engine_version:
        parts.append(f"SGLang {facts.engine_version}")
    return ", ".join(parts) + f"; measured by calibrate {when}."


def mib_down(n: float) -> str:
    """Free memory in whole MiB, rounded down (a budget never claims more than was measured)."""
    return f"{math.floor(n / MiB)}MiB"


def mib_up(n: float) -> str:
    """A cost or reserve in whole MiB, rounded up (an upper envelope stays one)."""
    return f"{math.ceil(n / MiB)}MiB"


# ------------------------------------------------------------------------------------------- editing
_TOP = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):(.*)$")


def _section(lines: list[str], key: str) -> tuple[int, int] | None:
    """(header line, end) of a top-level key's block; the end excludes the comments and blank lines
    that lead into the next top-level key (they belong to it)."""
    start = next((i for i, line in enumerate(lines) if (m := _TOP.match(line)) and m.group(1) == key), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if _TOP.match(lines[i])), len(lines))
    while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
        end -= 1
    return start, end


def _line(indent: str, key: str, value: object, comment: str | None) -> str:
    text = f"{indent}{key}: {value}"
    return f"{text:<44} # {comment}" if comment else text


def set_top(lines: list[str], key: str, value: str) -> None:
    """A top-level scalar (``name``, ``description``), its folded continuation lines replaced."""
    found = _section(lines, key)
    new = f"{key}: {value}"
    if found is None:
        lines.insert(0, new)
        return
    start, end = found
    lines[start:end] = [new]


def set_key(lines: list[str], section: str, key: str, value: object, comment: str | None) -> None:
    """One key of a section, with its comment; the section or key is added where missing."""
    found = _section(lines, section)
    if found is None:
        lines.extend(["", f"{section}:", _line("  ", key, value, comment)])
        return
    start, end = found
    pattern = re.compile(rf"^(\s+){re.escape(key)}:")
    for i in range(start + 1, end):
        if m := pattern.match(lines[i]):
            lines[i] = _line(m.group(1), key, value, comment)
            return
    lines.insert(end, _line("  ", key, value, comment))


def replace_section(lines: list[str], section: str, body: list[str]) -> None:
    found = _section(lines, section)
    if found is None:
        lines.extend(["", f"{section}:", *body])
        return
    start, end = found
    lines[start:end] = [f"{section}:", *body]


# ------------------------------------------------------------------------------------------- proposal
def cost_lines(fit_: Fit, run: ProbeRun, command: str, safety: float) -> list[str]:
    """The ``cost:`` body: where the fit came from, then one field a line, each saying what it is."""
    c = proposed_cost(fit_)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = [
        f"  # Measured by `{command}`",
        f"  # on {when}: {fit_.usable} usable probes, {run.tokens_sent:,} tokens, {run.duration_s:.0f} s.",
        f"  # Fit (upper envelope): margin {fit_.margin:.3f} = max(1, worst observed/predicted "
        f"{fit_.envelope_ratio:.3f}, 1 + 3 x noise {fit_.noise_sigma:.3f}) x (1 + safety {safety:g}).",
        f"  # Trusted up to {fit_.largest_prompt_tokens:,}-token prompts (the longest visible probe); beyond "
        "that the coefficients are extrapolated.",
        *(f"  # note: {n}" for n in fit_.notes),
    ]
    fields: list[tuple[str, object, str]] = [
        ("fixed_bytes", c["fixed_bytes"], "fitted: per prefill step"),
        (
            "activation_bytes_per_chunk_token",
            c["activation_bytes_per_chunk_token"],
            "fitted: per token of the chunk",
        ),
        ("context_bytes_per_token", c["context_bytes_per_token"], "fitted: per token of the whole context"),
        ("chunk_context_bytes", c["chunk_context_bytes"], "fitted: per chunk token x context token"),
        ("gather_bytes_per_context_token", c["gather_bytes_per_context_token"], "fitted: the capped gather"),
    ]
    if "gather_cap_bytes" in c:
        fields.append(("gather_cap_bytes", mib_up(float(c["gather_cap_bytes"])), "fitted: the gather's cap"))  # type: ignore[arg-type]
    fields += [
        ("batch_join_bytes", mib_up(float(c["batch_join_bytes"])), "group probes: peak over idle"),  # type: ignore[arg-type]
        (
            "batch_join_bytes_per_running_request",
            mib_up(float(c["batch_join_bytes_per_running_request"])),  # type: ignore[arg-type]
            "group probes: growth per running request",
        ),
        ("margin", c["margin"], f"worst observed/predicted x (1 + safety {safety:g}), see above"),
        ("calibrated_ratio", c["calibrated_ratio"], "worst observed/predicted: the monitor's yardstick"),
        ("calibrated_up_to_prompt_tokens", c["calibrated_up_to_prompt_tokens"], "the longest visible probe"),
    ]
    return head + [_line("  ", k, v, why) for k, v, why in fields]


def proposal_text(
    policy_text: str,
    fit_: Fit,
    run: ProbeRun,
    command: str,
    *,
    facts: LaneFacts | None = None,
    name: str | None = None,
    safety: float = 0.05,
) -> str:
    """The starting policy, edited for the measured lane; every line not rewritten is kept."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = policy_text.splitlines()
    replace_section(lines, "cost", cost_lines(fit_, run, command, safety))
    set_key(
        lines,
        "vram",
        "idle_free_bytes",
        mib_down(run.idle_free_bytes),
        "measured by calibrate: free before the first probe",
    )
    set_key(
        lines,
        "vram",
        "reserve_bytes",
        mib_up(fit_.reserve_bytes),
        f"calibrate: twice the worst excess over the fit, at least {MIN_RESERVE // MiB} MiB",
    )
    if facts is not None:
        _lane_from_engine(lines, facts, when)
        set_top(lines, "name", name or lane_name(facts))
        set_top(
            lines, "description", json.dumps(lane_description(facts, when))
        )  # a YAML double-quoted string
    elif name:
        set_top(lines, "name", name)
    header = [
        f"# Proposed by `{command}` on {when} for the lane it measured;",
        "# the comments below the cost section are the starting policy's. Review, then install it.",
    ]
    return "\n".join(header + lines) + "\n"


def _lane_from_engine(lines: list[str], facts: LaneFacts, when: str) -> None:
    src = f"/server_info, read by calibrate {when[:10]}"
    set_key(lines, "lane", "context_len", facts.context_len, f"{src} (context_length)")
    set_key(lines, "lane", "chunked_prefill_size", facts.chunked_prefill_size, src)
    if facts.kv_pool_tokens:
        set_key(lines, "lane", "kv_pool_tokens", facts.kv_pool_tokens, f"{src} (max_total_num_tokens)")
    if facts.mamba_slots:
        set_key(lines, "lane", "mamba_slots", facts.mamba_slots, "/metrics mamba used + available slots")
    if facts.max_running_requests:
        set_key(lines, "lane", "max_running_requests", facts.max_running_requests, src)
