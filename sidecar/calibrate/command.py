"""The edges of ``calibrate``: the engine over HTTP, the GPU source, and the command itself.

Probes are ``POST /generate`` bodies with ``input_ids`` (no tokenizer needed, exact lengths), one
request per prompt, ``max_new_tokens`` small; a group's requests are sent together. The engine's
state (busy or idle, chunk size, context) comes from the same scraper the proxy uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from sidecar.calibrate.fit import (
    Bounds,
    Coefficients,
    EngineInfo,
    Probe,
    fit,
    order_probes,
    plan_probes,
    proposed_cost,
    report,
    run_probes,
)
from sidecar.calibrate.proposal import LaneFacts, proposal_text
from sidecar.policy.schema import PolicyError, load_policy_file
from sidecar.signals.engine import EngineScraper, parse_server_info
from sidecar.signals.gpu import GpuSource, GpuSourceError, parse_gpu_source

EXIT_PROPOSED = 0
EXIT_USAGE = 2
EXIT_NOTHING_PROPOSED = 3
MiB = 1 << 20


class HttpLane:
    """An SGLang server (or the emulator) as a :class:`sidecar.calibrate.fit.Lane`."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._scraper = EngineScraper(self.base_url, api_key=api_key)
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._mamba_slots: int | None = None

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._scraper.aclose()

    async def info(self) -> EngineInfo:
        e = await self._scraper.poll_once()
        if e.chunked_prefill_size is None or e.context_len is None:
            raise RuntimeError(f"{self.base_url}/server_info gave no chunked_prefill_size/context_length")
        self._mamba_slots = e.mamba_total_slots or self._mamba_slots
        return EngineInfo(
            e.chunked_prefill_size,
            e.context_len,
            e.running_requests or 0,
            e.queue_requests or 0,
            e.pending_prefill_tokens or 0,
        )

    async def facts(self, info: EngineInfo) -> LaneFacts:
        """The lane as the engine reports it (``/server_info``; older engines ``/get_server_info``)."""
        raw: dict[str, object] = {}
        for path in ("/server_info", "/get_server_info"):
            try:
                resp = await self._client.get(f"{self.base_url}{path}", headers=self._auth)
            except httpx.HTTPError:
                break
            if resp.status_code == 200 and isinstance(body := resp.json(), dict):
                raw = body
                break
        parsed = parse_server_info(raw) if raw else {}
        fraction = raw.get("mem_fraction_static")
        model = raw.get("served_model_name") or raw.get("model_path")
        return LaneFacts(
            context_len=info.context_len,
            chunked_prefill_size=info.chunked_prefill_size,
            kv_pool_tokens=_int_or_none(parsed.get("max_total_tokens")),
            max_running_requests=_int_or_none(parsed.get("max_running_requests")),
            mamba_slots=self._mamba_slots,
            model=str(model) if model else None,
            mem_fraction_static=float(fraction) if isinstance(fraction, int | float) else None,
            engine_version=str(parsed["version"]) if parsed.get("version") else None,
        )

    async def _one(self, ids: list[int], max_new: int) -> str | None:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
            "stream": False,
        }
        try:
            resp = await self._client.post(f"{self.base_url}/generate", json=body, headers=self._auth)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc} (did the engine crash?)"
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}: {resp.text[:200]}"
        return None

    async def flush(self) -> bool:
        """SGLang's ``POST /flush_cache``: when the engine is idle it resets the radix cache and empties
        PyTorch's allocator cache (``Scheduler.flush_cache(empty_cache=True)``, docs/evidence.md RC2)."""
        try:
            resp = await self._client.post(f"{self.base_url}/flush_cache", headers=self._auth)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    @staticmethod
    def _prefix(probe: Probe, seq: int) -> tuple[random.Random, list[int]]:
        rng = random.Random(seq)  # distinct ids per probe: no probe hits another's cached prefix
        return rng, [rng.randrange(1000, 30000) for _ in range(probe.cached_tokens)]

    async def warm(self, probe: Probe, seq: int) -> str | None:
        """Send only the probe's cached prefix (the radix cache keeps it for :meth:`send`)."""
        _rng, prefix = self._prefix(probe, seq)
        return await self._one(prefix, 1) if prefix else None

    async def send(self, probe: Probe, seq: int, warmed: bool = False) -> str | None:
        rng, prefix = self._prefix(probe, seq)
        if prefix and not warmed:
            err = await self._one(prefix, 1)
            if err is not None:
                return err
        new = probe.prompt_tokens - probe.cached_tokens
        bodies = [prefix + [rng.randrange(1000, 30000) for _ in range(new)] for _ in range(probe.concurrent)]
        errors = await asyncio.gather(*(self._one(ids, probe.max_new_tokens) for ids in bodies))
        return next((e for e in errors if e is not None), None)


class GpuMeter:
    """A GPU source as a :class:`sidecar.calibrate.fit.Meter`: the engine's held bytes are total - free -
    what other processes hold (NVML reports them per process; other sources count as 0)."""

    def __init__(self, source: GpuSource) -> None:
        self.source = source

    async def _read(self) -> tuple[int, int, int]:
        g = await self.source.read(time.monotonic())
        if g.free_bytes is None or g.total_bytes is None:
            raise GpuSourceError(f"{self.source.spec}: no device reported")
        return g.free_bytes, g.total_bytes, g.other_process_bytes or 0

    async def held_bytes(self) -> int:
        free, total, other = await self._read()
        return total - free - other

    async def free_bytes(self) -> int:
        return (await self._read())[0]

    async def device(self) -> tuple[str | None, int | None]:
        """The deciding device's name (NVML UUID, file path) and total memory."""
        g = await self.source.read(time.monotonic())
        if not g.devices:
            return None, None
        d = min(g.devices, key=lambda d: d.free_bytes)
        return d.ident, d.total_bytes


def _int_or_none(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def add_parser(sub: argparse._SubParsersAction, formatter: type = argparse.HelpFormatter) -> None:  # type: ignore[type-arg]
    c = sub.add_parser(
        "calibrate",
        formatter_class=formatter,
        help="qualify an idle lane: probe it, fit the cost model, write a proposed policy",
        description="Send probe requests of increasing length to an IDLE engine, read the GPU source "
        "before/during/after each, fit the policy's cost terms as an upper envelope and write a proposed "
        "policy. Never changes the running policy. Exit 0: proposed; 3: nothing proposed (busy lane, too "
        "few usable probes); 2: usage.",
    )
    c.add_argument("--upstream", metavar="URL", help="SGLang base URL (not the sidecar)")
    c.add_argument("--gpu-source", metavar="SPEC", help="nvml | nvml:<uuid> | dcgm:<url> | file:<path>")
    c.add_argument("--policy", metavar="FILE", required=True, help="the lane's current policy (read only)")
    c.add_argument("--out", metavar="PROPOSED.yaml", help="where to write the proposed policy")
    c.add_argument("--max-prompt-tokens", type=int, metavar="N", help="longest probe (default: the context)")
    c.add_argument("--max-total-tokens", type=int, default=12_000_000, metavar="N", help="token budget")
    c.add_argument("--max-duration-s", type=float, default=900.0, metavar="S", help="time budget")
    c.add_argument("--safety", type=float, default=0.05, help="stated margin on top of the envelope (0.05)")
    c.add_argument("--cached-prefix", action="store_true", help="also probe a request with a cached prefix")
    c.add_argument(
        "--no-flush",
        action="store_true",
        help="do not flush the engine's caches (POST /flush_cache) before each probe",
    )
    c.add_argument(
        "--settle-s",
        type=float,
        default=5.0,
        metavar="S",
        help="wait this long for the engine to empty its allocator cache while idle before a multi-chunk "
        "probe's last chunk (SGLang --sleep-on-idle, SGLANG_EMPTY_CACHE_INTERVAL); 0: read cold probes",
    )
    c.add_argument("--dry-run", action="store_true", help="print the probe plan and exit")
    c.add_argument("--json", metavar="OUT", help="also write the observations and the fit as JSON")
    c.add_argument("--name", help="the proposal's policy name (default: from the model and context)")
    c.add_argument("--quiet", action="store_true", help="no progress lines on stderr while probing")


def main(args: argparse.Namespace) -> int:
    try:
        loaded = load_policy_file(args.policy)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    policy = loaded.policy
    start = Coefficients.of(policy.cost)
    chunk, context = policy.lane.chunked_prefill_size, policy.lane.context_len
    if args.dry_run:
        probes = plan_probes(
            chunk,
            context,
            max_prompt_tokens=args.max_prompt_tokens,
            max_total_tokens=args.max_total_tokens,
            cached=args.cached_prefix,
        )
        print(
            f"probe plan from {args.policy} (chunk {chunk:,}, context {context:,}; the engine's values win):"
        )
        singles = [p for p in probes if p.concurrent == 1]
        groups = [p for p in probes if p.concurrent > 1]
        for p in [*order_probes(singles, lambda p: start.probe_peak(p, chunk)), *groups]:
            print(
                f"  {p.name:18} {p.kind:7} {p.tokens_sent:>10,} tokens  policy predicts "
                f"{start.probe_peak(p, chunk) / MiB:9,.1f} MiB"
            )
        when = {
            None: "after the first five multi-chunk singles (join never measured)",
            0.0: "first (the policy measured no join)",
        }.get(start.batch_join_bytes, "where their predicted peak falls")
        print(f"  groups run {when}")
        print(
            f"  total {sum(p.tokens_sent for p in probes):,} tokens (bound {args.max_total_tokens:,}); "
            "single probes run in increasing predicted peak, groups once the short singles are in; "
            "probes predicted above 90 % of the idle headroom are skipped"
        )
        return 0
    missing = [f for f in ("upstream", "gpu_source", "out") if not getattr(args, f)]
    if missing:
        print(
            f"sglang-sidecar calibrate: error: needs --{', --'.join(m.replace('_', '-') for m in missing)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        source = parse_gpu_source(args.gpu_source)
    except ValueError as e:
        print(f"sglang-sidecar calibrate: error: --gpu-source: {e}", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(_calibrate(args, loaded.policy, Path(args.policy).read_text(), source))


async def _calibrate(args: argparse.Namespace, policy, policy_text: str, source: GpuSource) -> int:  # type: ignore[no-untyped-def]
    lane = HttpLane(args.upstream)
    try:
        try:
            info = await lane.info()
        except Exception as e:  # an unreachable engine is the user's to fix: say which URL
            print(f"sglang-sidecar calibrate: error: cannot read {args.upstream}: {e}", file=sys.stderr)
            return EXIT_USAGE
        probes = plan_probes(
            info.chunked_prefill_size,
            info.context_len,
            max_prompt_tokens=args.max_prompt_tokens,
            max_total_tokens=args.max_total_tokens,
            cached=args.cached_prefix,
        )
        bounds = Bounds(
            args.max_prompt_tokens,
            args.max_total_tokens,
            args.max_duration_s,
            reserve_bytes=int(policy.vram.reserve_bytes),
            flush=not getattr(args, "no_flush", False),
            settle_s=float(getattr(args, "settle_s", 5.0)),
        )
        meter = GpuMeter(source)
        say = None if getattr(args, "quiet", False) else _progress
        try:
            run = await run_probes(lane, meter, probes, Coefficients.of(policy.cost), bounds, progress=say)
            facts = await lane.facts(run.info)
            gpu, total = await meter.device()
            facts = replace(facts, gpu=gpu, gpu_total_bytes=total)
        except GpuSourceError as e:
            print(f"sglang-sidecar calibrate: error: {e.message}", file=sys.stderr)
            return EXIT_USAGE
    finally:
        await lane.aclose()
        await source.aclose()
    result = fit(run, safety=args.safety) if run.refused is None else run.refused
    print(report(result, run, policy))
    if args.json:
        Path(args.json).write_text(json.dumps(_as_json(run, result), indent=2))
    if isinstance(result, str):
        print("nothing proposed", file=sys.stderr)
        return EXIT_NOTHING_PROPOSED
    command = "sglang-sidecar calibrate " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else [])
    text = proposal_text(
        policy_text, result, run, command, facts=facts, name=getattr(args, "name", None), safety=args.safety
    )
    Path(args.out).write_text(text)
    print(f"proposed policy written to {args.out} (the running policy is unchanged)")
    return EXIT_PROPOSED


def _as_json(run, result) -> dict[str, object]:  # type: ignore[no-untyped-def]
    obs = [
        {
            "probe": o.probe.name,
            "kind": o.probe.kind,
            "prompt_tokens": o.probe.prompt_tokens,
            "concurrent": o.probe.concurrent,
            "before_bytes": o.before,
            "after_bytes": o.after,
            "censored": o.censored,
            "exact": o.exact,
            "predicted_bytes": o.predicted,
            "error": o.error,
        }
        for o in run.observations
    ]
    out: dict[str, object] = {
        "idle_free_bytes": run.idle_free_bytes,
        "observations": obs,
        "skipped": [[p.name, why] for p, why in run.skipped],
        "tokens_sent": run.tokens_sent,
        "duration_s": run.duration_s,
    }
    if isinstance(result, str):
        out["nothing_proposed"] = result
    else:
        out["cost"] = proposed_cost(result)
        out["notes"] = list(result.notes)
        out["residuals"] = [
            {
                "probe": r.probe.name,
                "observed_bytes": r.observed,
                "predicted_bytes": r.predicted,
                "censored": r.censored,
            }
            for r in result.residuals
        ]
    return out
