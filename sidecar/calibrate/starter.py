"""``sglang-sidecar init``: a starting policy for the lane in front of it, to be refined by ``calibrate``.

What the lane *is* is read from it: the engine's constants (``/server_info``, ``/metrics``, through
the proxy's own scraper) and its idle free GPU memory (the GPU source, read while the engine runs
nothing). What it *costs* cannot be read without probing it, which is ``calibrate``'s job: until
then the cost terms are the largest this project has measured (the old full-context-gather build of
a Qwen3-Next-class model, ``docs/evidence.md``) with a 25 % margin, and the monitor raises the margin
when a GPU reading shows more allocated than projected. A model with larger activations than those
can still exceed them: the header says to run shadow mode and ``calibrate`` before enforcing.

Every field carries a one-line comment saying where its figure comes from. The text is validated by
the same loader as ``check-policy`` before it is written.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from sidecar.policy.schema import PolicyError, load_policy_text
from sidecar.signals.engine import EngineScraper
from sidecar.signals.gpu import GpuSourceError, parse_gpu_source

EXIT_WRITTEN = 0
EXIT_CANNOT_READ = 1
EXIT_USAGE = 2
MiB = 1 << 20
# Kept out of every transient until calibrate measures the lane's own under-predictions (calibrate
# proposes twice the worst one, at least 16 MiB): four times that floor, for an unmeasured lane.
START_RESERVE_MIB = 64
START_MARGIN = 1.25
# Hold bounds from the lane (issue 29: another lane's "assumed" 300 s / 128 parked requests for minutes
# on a dense lane with a ~33K-token pool). A held request waits at most for HOLD_POOLS pools' worth of
# prefill at the rate the probe measured, and the queue holds that much work in chunk-sized requests;
# clamped to what clients tolerate (HOLD_WAIT_BOUNDS_S) and to a sane queue (HOLD_HELD_BOUNDS).
HOLD_POOLS = 2
HOLD_WAIT_BOUNDS_S = (10, 300)
HOLD_HELD_BOUNDS = (4, 128)
# Until a probe measures it: the old default, good for a Retry-After hint only (serve refuses on the
# expected wait only at a rate it measured: ``decide.expected_wait_s``).
ASSUMED_PREFILL_TOKENS_PER_S = 20000


@dataclass(frozen=True)
class LaneReading:
    """What ``init`` read of the lane: the engine's constants and the GPU source's devices."""

    upstream: str
    gpu_spec: str
    context_len: int
    chunked_prefill_size: int
    kv_pool_tokens: int | None
    mamba_slots: int | None
    mamba_from: str
    max_running_requests: int | None
    version: str | None
    running: int | None
    queued: int | None
    free_bytes: int
    total_bytes: int | None
    other_process_bytes: int | None
    devices: int
    at: str

    pending_prefill_tokens: int | None
    # Prefill tokens per second one cold chunk-sized probe took on the idle engine (None: not probed).
    prefill_tokens_per_s: float | None = None

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.queued == 0 and not self.pending_prefill_tokens


class CannotRead(Exception):
    """The engine or the GPU source did not give what a starting policy needs."""


async def read_lane(upstream: str, gpu_spec: str) -> LaneReading:
    """One reading of the engine (its scraper: /metrics, /server_info, /v1/loads) and of the GPU source."""
    try:
        source = parse_gpu_source(gpu_spec)
    except ValueError as e:
        raise CannotRead(f"--gpu-source: {e}") from None
    try:
        scraper = EngineScraper(upstream)
    except ValueError as e:
        raise CannotRead(f"--upstream: {e}") from None
    try:
        e = await scraper.poll_once()
        g = await source.read(time.monotonic())
    except GpuSourceError as err:
        raise CannotRead(f"GPU source {gpu_spec}: {err}") from None
    except Exception as err:  # the scraper's errors name the URL and what was wrong
        raise CannotRead(f"engine at {upstream}: {err}") from None
    finally:
        await scraper.aclose()
        await source.aclose()
    if e.context_len is None or e.chunked_prefill_size is None:
        raise CannotRead(
            f"engine at {upstream}: /server_info gave no context_length/chunked_prefill_size "
            "(is it an SGLang server?)"
        )
    if g.free_bytes is None:
        raise CannotRead(f"GPU source {gpu_spec}: no device reported")
    mamba, mamba_from = e.mamba_total_slots, "/metrics Mamba used + available slots"
    if mamba is None and (configured := await _server_arg(upstream, "max_mamba_cache_size")):
        # An engine that has not published its Mamba gauges yet (before its first batch): its setting.
        mamba, mamba_from = (
            configured,
            "/server_info max_mamba_cache_size (a cap; the gauges win: evidence V2)",
        )
    return LaneReading(
        upstream=upstream,
        gpu_spec=gpu_spec,
        context_len=e.context_len,
        chunked_prefill_size=e.chunked_prefill_size,
        kv_pool_tokens=e.max_total_tokens,
        mamba_slots=mamba,
        mamba_from=mamba_from,
        max_running_requests=e.max_running_requests,
        version=e.version,
        running=e.running_requests,
        queued=e.queue_requests,
        pending_prefill_tokens=e.pending_prefill_tokens,
        free_bytes=g.free_bytes,
        total_bytes=g.total_bytes,
        other_process_bytes=g.other_process_bytes,
        devices=len(g.devices),
        at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )


async def probe_prefill_rate(upstream: str, tokens: int) -> float | None:
    """Prefill tokens per second of one cold prompt of ``tokens`` (the engine's chunk) on the idle
    engine: ``POST /generate`` with ``input_ids`` and one new token, timed end to end. The time also
    holds one decode step and the HTTP round trip, so the rate is an under-estimate: the hold bounds
    it gives are on the short side. None when the engine does not answer 200."""
    import random

    import httpx

    rng = random.Random()  # fresh ids each run: no radix-cache hit on an earlier probe's prefix
    ids = [rng.randrange(1000, 30000) for _ in range(tokens)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "stream": False}
    try:
        async with httpx.AsyncClient(timeout=600.0) as client:
            started = time.perf_counter()
            resp = await client.post(upstream.rstrip("/") + "/generate", json=body)
            took = time.perf_counter() - started
    except httpx.HTTPError:
        return None
    return tokens / took if resp.status_code == 200 and took > 0 else None


def hold_bounds(r: LaneReading) -> tuple[int, int, int, str]:
    """``max_wait_s``, ``max_held`` and ``prefill_tokens_per_s`` for this lane, and where they come
    from: the pool (``kv_pool_tokens``, else the context) and the probed prefill rate."""
    rate = r.prefill_tokens_per_s
    pool = r.kv_pool_tokens or r.context_len
    held = -(-HOLD_POOLS * pool // max(1, r.chunked_prefill_size))
    held = min(HOLD_HELD_BOUNDS[1], max(HOLD_HELD_BOUNDS[0], held))
    if rate is None:
        rate_used, said = ASSUMED_PREFILL_TOKENS_PER_S, "assumed (no probe)"
    else:
        rate_used, said = rate, f"probed: one {r.chunked_prefill_size:,}-token cold prefill"
    wait = -(-HOLD_POOLS * pool // max(1, round(rate_used)))
    wait = min(HOLD_WAIT_BOUNDS_S[1], max(HOLD_WAIT_BOUNDS_S[0], wait))
    return wait, held, max(1, round(rate_used)), said


async def _server_arg(upstream: str, key: str) -> int | None:
    """One positive integer server argument from ``/server_info`` (None when absent or unset)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            info = (await client.get(upstream.rstrip("/") + "/server_info")).json()
    except (httpx.HTTPError, ValueError):
        return None
    value = info.get(key) if isinstance(info, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def _mib(b: int) -> str:
    return f"{b // MiB}MiB"


def starter_text(r: LaneReading, name: str) -> str:
    """The policy as YAML with a comment per field; pure (``init``'s tests check it over HTTP too)."""
    where = f"{r.upstream}, SGLang {r.version or '(version not reported)'}, read {r.at}"
    lane = [
        f"  context_len: {r.context_len}  # /server_info context_length of {r.upstream}",
        f"  chunked_prefill_size: {r.chunked_prefill_size}  # /server_info chunked_prefill_size",
    ]
    if r.kv_pool_tokens is not None:
        lane.append(f"  kv_pool_tokens: {r.kv_pool_tokens}  # /metrics sglang:max_total_num_tokens")
    if r.mamba_slots is not None:
        lane.append(f"  mamba_slots: {r.mamba_slots}  # {r.mamba_from}")
    if r.max_running_requests is not None:
        lane.append(f"  max_running_requests: {r.max_running_requests}  # /server_info max_running_requests")
    wait, held, rate, rate_from = hold_bounds(r)
    pool = r.kv_pool_tokens or r.context_len
    idle_source = f"{r.gpu_spec}, {r.devices} device(s), the one with least free memory"
    if r.idle:
        idle = f"  idle_free_bytes: {_mib(r.free_bytes)}  # measured now: {idle_source}, engine idle"
    else:
        idle = (
            f"  idle_free_bytes: auto  # the engine was busy ({r.running} running, {r.queued} queued): "
            "the sidecar measures it when idle"
        )
    other = (
        [
            f"  other_processes_bytes: {_mib(r.other_process_bytes)}  # other processes on the card now ({r.gpu_spec})"
        ]
        if r.other_process_bytes
        else []
    )
    mamba = (
        [
            "mamba:",
            "  max_usage: 0.9  # assumed: one long request's checkpoints can take several slots at once",
        ]
        if r.mamba_slots is not None
        else []
    )
    lines = [
        f"# Starting policy written by `sglang-sidecar init` for {where}.",
        "# The lane section and the idle free memory are this lane's own; the cost terms are the largest",
        "# this project has measured (Qwen3-Next-class model, old full-context-gather build: docs/evidence.md)",
        "# and a model with larger activations can exceed them. Run it in shadow mode first (--mode shadow),",
        "# then refine it on an idle lane before enforcing:",
        f"#   sglang-sidecar calibrate --upstream {r.upstream} --gpu-source {r.gpu_spec} --policy THIS.yaml --out PROPOSED.yaml",
        f"name: {name}",
        f"description: Starting policy for {r.upstream} (sglang-sidecar init, {r.at}); refine with calibrate.",
        "",
        "lane:",
        *lane,
        "",
        "cost:",
        "  fixed_bytes: 0  # no fixed term was seen on any lane measured so far (evidence D14)",
        "  activation_bytes_per_chunk_token: 12KiB  # per chunk token, Qwen3-Next class (evidence D2, D14)",
        "  context_bytes_per_token: 2735  # context temporaries per prompt token (evidence D2)",
        "  gather_bytes_per_context_token: 2KiB  # the uncapped full-context gather, the worst build known (evidence D1)",
        "  batch_join_bytes: 1248MiB  # a finished prefill joining the running batch (evidence M3)",
        f"  margin: {START_MARGIN}  # assumed: 25 % on every term until calibrate measures this lane",
        "",
        "vram:",
        "  headroom: idle_budget  # a caching PyTorch engine keeps live free memory at its low-water mark",
        idle,
        *other,
        f"  reserve_bytes: {START_RESERVE_MIB}MiB  # assumed: never handed out; 4x calibrate's 16 MiB floor for an unmeasured lane",
        "",
        "kv:",
        "  max_usage: 0.95  # assumed: leaves decode room in the pool",
        *mamba,
        "",
        "engine_queue:",
        "  max_requests: 4  # assumed: the engine's own queue stays short, the sidecar holds the rest",
        "",
        "pending_prefill:",
        f"  max_tokens: {2 * r.context_len}  # assumed: two full-context prompts waiting to prefill",
        "",
        "engine:",
        "  poll_interval_s: 0.5  # how often /metrics is read",
        "  max_age_s: 5  # older engine signals are stale",
        "  on_stale: hold  # no admission blind",
        "",
        "gpu:",
        "  poll_interval_s: 0.1  # ~6 us per NVML read (evidence N3)",
        "  max_age_s: 2  # older GPU readings are stale",
        "  on_stale: hold  # no admission blind",
        "  required: true  # serve needs --gpu-source",
        "",
        "hold:",
        f"  max_held: {held}  # {HOLD_POOLS} pools of {pool:,} tokens in {r.chunked_prefill_size:,}-token requests; beyond it, queue_full",
        f"  max_wait_s: {wait}  # {HOLD_POOLS} pools' prefill at the rate below (within {HOLD_WAIT_BOUNDS_S[0]}-{HOLD_WAIT_BOUNDS_S[1]} s); longer expected waits are refused at once",
        "  retry_after_max_s: 60  # long prefills take minutes",
        f"  prefill_tokens_per_s: {rate}  # {rate_from}; serve measures the lane's own from its prefills",
        "",
        "monitor:",
        "  raise_margin: true  # a GPU reading above the projection raises the margin, up to max_margin",
        "  max_margin: 2.0  # assumed: room for a model whose activations exceed the terms above",
    ]
    return "\n".join(lines) + "\n"


def policy_name(upstream: str) -> str:
    """A name from the upstream's host and port (``lane-127-0-0-1-30000``)."""
    host = re.sub(r"^https?://", "", upstream).split("/")[0]
    return "lane-" + re.sub(r"[^A-Za-z0-9]+", "-", host).strip("-").lower()


def add_parser(sub: argparse._SubParsersAction, formatter: type = argparse.HelpFormatter) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "init",
        formatter_class=formatter,
        help="write a starting policy for the lane in front of it (refine it with calibrate)",
        description="Read the engine's constants (/server_info, /metrics) and its idle free GPU memory, and "
        "write a starting policy with conservative cost terms; it passes check-policy. Then run the lane "
        "in shadow mode and refine the policy with calibrate.",
        epilog="Exit status: 0 written, 1 the engine or the GPU source could not be read, 2 usage or an "
        "output that cannot be written.",
    )
    p.add_argument(
        "--upstream", required=True, metavar="URL", help="the SGLang server, e.g. http://127.0.0.1:30000"
    )
    p.add_argument(
        "--gpu-source",
        required=True,
        metavar="SPEC",
        help="nvml | nvml:<uuid>[,<uuid>] | dcgm:<url> | file:<path>",
    )
    p.add_argument(
        "-o", "--out", metavar="FILE", help="write here (default: standard output); never overwrites"
    )
    p.add_argument("--name", default=None, help="the policy's name (default: lane-<host>-<port>)")
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="do not time one chunk-sized prefill on the idle engine (the hold bounds then use an assumed rate)",
    )


def main(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    if out is not None and out.exists():
        print(f"sglang-sidecar init: {out} exists; not overwritten (choose another -o)", file=sys.stderr)
        return EXIT_USAGE
    try:
        reading = asyncio.run(read_lane(args.upstream, args.gpu_source))
    except CannotRead as e:
        print(f"sglang-sidecar init: {e}", file=sys.stderr)
        return EXIT_CANNOT_READ
    if reading.idle and not args.no_probe:
        # After the idle reading: the probe's allocations do not show in idle_free_bytes.
        print(
            f"sglang-sidecar init: probing the prefill rate: one {reading.chunked_prefill_size:,}-token prompt",
            file=sys.stderr,
        )
        rate = asyncio.run(probe_prefill_rate(args.upstream, reading.chunked_prefill_size))
        reading = replace(reading, prefill_tokens_per_s=rate)
    text = starter_text(reading, args.name or policy_name(args.upstream))
    try:
        load_policy_text(text, str(out or "<init>"))
    except PolicyError as e:  # a bug here, never the user's: say so rather than write it
        print(
            f"sglang-sidecar init: the starting policy does not validate (please report):\n{e}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not reading.idle:
        print(
            f"sglang-sidecar init: the engine was busy ({reading.running} running, {reading.queued} queued): "
            "idle_free_bytes is auto (the sidecar measures it when idle)",
            file=sys.stderr,
        )
    if out is None:
        sys.stdout.write(text)
        return EXIT_WRITTEN
    try:
        with out.open("x", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        print(f"sglang-sidecar init: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    print(
        f"{out}: starting policy for {args.upstream}; next: sglang-sidecar check-policy {out}",
        file=sys.stderr,
    )
    return EXIT_WRITTEN
