"""``demo`` (and ``make demo``): the outage, live on loopback, first without the gate, then with it.

Everything is real but the GPU: the engine emulator serves SGLang's HTTP API on a free port and
publishes its device memory through the ``file:`` GPU source; the sidecar is the real proxy with the
real policy; the clients are the scenario's agents and burst, speaking HTTP and honouring Retry-After.
The engine runs ``speed`` times faster than real time, and the sidecar's clocks (poll intervals,
staleness, hold times) are scaled by the same factor, so the gate sees the same lag in engine seconds
as it would on a real lane. Times in the output are engine seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.policy.schema import LoadedPolicy, Policy, PolicyError, load_policy_file
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.replay import (
    AgentClient,
    Attempt,
    BurstClient,
    Client,
    FixedRequests,
    RequestRecord,
    RoundsClient,
    format_table,
    outcome_summary,
)
from sidecar_emulator.scenario import Agents, Burst, GpuEvent, Requests, Rounds, Scenario, load_scenario
from sidecar_emulator.server import EmulatorServer, build_emulator_app, build_model

DEFAULT_SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "maxq-outage-burst.yaml"
DEFAULT_SPEED = 25.0
# Engine seconds each phase runs: long enough for the burst, the crash and the gated run to finish.
WINDOW_S = 240.0


def scale_policy(loaded: LoadedPolicy, speed: float) -> LoadedPolicy:
    """The policy with its clocks run ``speed`` times faster, to match an emulator at ``speed``."""
    p = loaded.policy

    def fast(s: float, floor: float) -> float:
        return max(floor, s / speed)

    engine = p.engine.model_copy(
        update={
            "poll_interval_s": fast(p.engine.poll_interval_s, 0.02),
            "max_age_s": fast(p.engine.max_age_s, 0.2),
        }
    )
    gpu = p.gpu.model_copy(
        update={"poll_interval_s": fast(p.gpu.poll_interval_s, 0.01), "max_age_s": fast(p.gpu.max_age_s, 0.1)}
    )
    hold = p.hold.model_copy(
        update={
            "max_wait_s": fast(p.hold.max_wait_s, 1.0),
            "retry_after_max_s": max(p.hold.retry_after_min_s, round(p.hold.retry_after_max_s / speed)),
            "prefill_tokens_per_s": p.hold.prefill_tokens_per_s * speed,
        }
    )
    policy = Policy.model_validate(
        p.model_dump() | {"engine": engine.model_dump(), "gpu": gpu.model_dump(), "hold": hold.model_dump()}
    )
    return LoadedPolicy(policy, loaded.sha256, loaded.path)


class LiveDriver:
    """The replay clients' driver, over real HTTP and the emulator's clock (engine seconds)."""

    def __init__(
        self,
        scenario: Scenario,
        url: str,
        engine_now: Callable[[], float],
        speed: float,
        session: aiohttp.ClientSession,
        seed: int,
    ) -> None:
        self.scenario = scenario
        self.url = url
        self._engine_now = engine_now
        self._t0 = engine_now()
        self.speed = speed
        self.session = session
        self.rng = random.Random(seed)
        self.records: dict[str, RequestRecord] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.timers: set[asyncio.TimerHandle] = set()
        self._rids: Counter[str] = Counter()
        self.loop = asyncio.get_running_loop()
        self.clients: list[Client] = []

    @property
    def t(self) -> float:
        return self._engine_now() - self._t0

    def at(self, t: float, fn: Callable[[], None], housekeeping: bool = False) -> None:
        """Run ``fn`` at engine time ``t``; pending calls keep the phase alive until the window ends."""

        def run() -> None:
            self.timers.discard(handle)
            fn()

        handle = self.loop.call_later(max(0.0, (t - self.t) / self.speed), run)
        self.timers.add(handle)

    def new_rid(self, prefix: str) -> str:
        self._rids[prefix] += 1
        return f"{prefix}-{self._rids[prefix]}"

    def send(self, client: Client, a: Attempt) -> None:
        a.arrival = self.t
        self.records[a.rid] = RequestRecord(a.rid, round(a.arrival, 3), a.prompt_tokens)
        task = asyncio.create_task(self._http(a))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _http(self, a: Attempt) -> None:
        rec = self.records[a.rid]
        body = {
            "text": "(a long agent context)",
            "stream": True,
            "rid": a.rid,
            "priority": a.priority,
            "sampling_params": {"max_new_tokens": a.max_new_tokens},
            "emulator": {"prompt_tokens": a.prompt_tokens, "prefix_key": a.prefix},
        }
        ok, retry_after, give_up = False, None, False
        try:
            async with self.session.post(self.url + "/generate", json=body) as resp:
                if resp.headers.get("x-admission-decision") == "reject":
                    rec.outcome = f"rejected:{resp.headers.get('x-admission-reason')}"
                    give_up = resp.headers.get("x-should-retry") == "false"
                    if "retry-after" in resp.headers:
                        retry_after = float(resp.headers["retry-after"]) * self.speed
                        rec.retry_after_s = retry_after
                else:
                    wait_ms = float(resp.headers.get("x-admission-wait-ms", "0"))
                    rec.held_s = round(wait_ms / 1000 * self.speed, 3)
                    done = False
                    async for line in resp.content:
                        if rec.ttft_s is None and line.startswith(b"data:"):
                            rec.ttft_s = round(self.t - a.arrival, 3)
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif b'"completion_tokens"' in line:
                            with contextlib.suppress(ValueError, KeyError):
                                meta = json.loads(line[5:])["meta_info"]
                                rec.completion_tokens = int(meta["completion_tokens"])
                    ok = resp.status == 200 and done
                    rec.outcome = "completed" if ok else "failed"
        except (TimeoutError, aiohttp.ClientError):
            rec.outcome = "failed"
        rec.end = round(self.t, 3)
        a.client.on_done(a, ok, retry_after, give_up)

    def start_clients(self) -> None:
        groups: dict[str, list[AgentClient]] = {}
        for w in self.scenario.workload:
            if isinstance(w, Requests):
                self.clients.append(FixedRequests(self, w))  # type: ignore[arg-type]
            elif isinstance(w, Burst):
                self.clients.append(BurstClient(self, w))  # type: ignore[arg-type]
            elif isinstance(w, Rounds):
                self.clients.append(RoundsClient(self, w))  # type: ignore[arg-type]
            elif isinstance(w, Agents):
                agents = [AgentClient(self, w, i) for i in range(w.count)]  # type: ignore[arg-type]
                groups.setdefault(w.name, []).extend(agents)
                self.clients.extend(agents)
        for c in self.clients:
            if isinstance(c, AgentClient) and c.spec.join is not None:
                groups[c.spec.join.after][0].listeners.append((c.spec.join.turn, lambda c=c: c.start(self.t)))
            else:
                c.start()


async def run_phase(
    scenario: Scenario,
    policy: LoadedPolicy | None,
    speed: float,
    seed: int,
    label: str,
    window_s: float,
    *,
    cuda: bool = False,
    watch: Callable[[str], Awaitable[None]] | None = None,
    gpu_source: str | None = None,
    on_gpu_event: Callable[[GpuEvent], None] | None = None,
) -> dict[str, Any]:
    """One run: emulator (+ sidecar when ``policy`` is given) on loopback, the scenario's clients.

    ``cuda``: the emulator allocates its pool and every transient on the real GPU (a crash is CUDA's
    own out-of-memory error) and the sidecar reads real NVML instead of the emulator's file.
    ``watch``: called with the sidecar's admin URL while the phase runs (a test reads the live view
    there); cancelled when the phase ends.
    ``gpu_source``: the sidecar's GPU source spec instead (``nvml:<uuid>,<uuid>`` for a TP lane's
    cards). ``on_gpu_event``: what a scenario's GPU event does instead of changing the model's
    neighbour (on real cards: start a real neighbour process, ``bench/cuda_gate.py --tp``).
    """
    from sidecar.app import SidecarApp
    from sidecar.http.server import serve_sidecar
    from sidecar.signals.gpu import parse_gpu_source

    profile = get_profile(scenario.profile)
    model = build_model(profile, seed, cuda=cuda)
    with tempfile.TemporaryDirectory(prefix="sidecar-demo-") as tmp:
        gpu_file = Path(tmp) / "gpu.json"
        emu_app = build_emulator_app(model, speed, gpu_file)
        async with EmulatorServer(emu_app) as emu:
            url = emu.url
            app: SidecarApp | None = None
            stack = contextlib.AsyncExitStack()
            async with stack:
                if policy is not None:
                    app = SidecarApp(
                        upstream=emu.url,
                        policy=policy,
                        gpu_source=parse_gpu_source(gpu_source or ("nvml" if cuda else f"file:{gpu_file}")),
                        # The demo's clients describe 500K-token prompts to the emulator by size.
                        trust_emulator_sizes=True,
                        decision_log=stack.enter_context((Path(tmp) / "decisions.jsonl").open("w")),
                    )
                    url, admin = await stack.enter_async_context(serve_sidecar(app))
                    print(
                        f"  live view while it runs: sglang-sidecar status --watch --interval 0.5 --admin {admin}"
                        f"\n                       or open {admin}/admission/status",
                        flush=True,
                    )
                    if watch is not None:
                        watcher = asyncio.create_task(watch(admin))
                        stack.push_async_callback(_cancel, watcher)
                timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    driver = LiveDriver(scenario, url, emu.emulator.now, speed, session, seed)
                    driver.start_clients()
                    for ev in scenario.gpu_events:
                        driver.at(
                            ev.t,
                            (lambda ev=ev: on_gpu_event(ev))
                            if on_gpu_event is not None
                            else lambda ev=ev: model.set_other_process_bytes(
                                int(ev.other_process_bytes), emu.emulator.now(), ev.gpu
                            ),
                        )
                    await _progress(driver, model, app, label, window_s)
                    for handle in driver.timers:
                        handle.cancel()
                    for task in list(driver.tasks):
                        task.cancel()
                    await asyncio.gather(*driver.tasks, return_exceptions=True)
                ledger = app.admission.ledger.totals.requests if app else 0
                gpu_seen = app.admission.snapshot.gpu if app else None
    model.release_device()
    crashes = [
        {
            "t": round(c.t - driver._t0, 3),
            "reason": c.reason,
            "requested_bytes": c.requested_bytes,
            "free_bytes": c.free_bytes,
        }
        for c in model.crashes
    ]
    # Downtime is the whole restart, even past the window: the lane is down that long regardless.
    out = outcome_summary(list(driver.records.values()), crashes, profile.restart_s, float("inf"))
    out["gate"] = policy is not None
    out["ledger_at_end"] = ledger
    out["requests_detail"] = [r.__dict__ for r in driver.records.values()]
    out["gpu_source"] = gpu_seen.source if gpu_seen else None
    out["gpu_free_bytes_last"] = gpu_seen.free_bytes if gpu_seen else None
    return out


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _progress(driver: LiveDriver, model: Any, app: Any, label: str, window_s: float) -> None:
    """One status line per engine-time step, until the window ends or everything has settled."""
    step = window_s / 12
    next_line = 0.0
    while driver.t < window_s:
        await asyncio.sleep(0.05)
        if driver.t >= next_line:
            next_line += step
            recs = driver.records.values()
            counts = Counter(r.outcome.split(":")[0] for r in recs)
            if model.up:
                g = model.live_gauges()
                engine = f"running {g.num_running_reqs:2d} queue {g.num_queue_reqs:2d} free {model.free_bytes() / 2**30:5.2f} GiB"
            else:
                engine = f"DOWN (crashed; restarts in {model.down_until - model.now:4.0f} s)"
            held = f" held {app.admission.held:2d}" if app is not None else ""
            print(
                f"  [{label:8}] t={driver.t:5.0f}s  engine: {engine:44}{held}  "
                f"sent {len(driver.records):3d} done {counts['completed']:3d} failed {counts['failed']:3d} "
                f"rejected {counts['rejected']:3d}",
                flush=True,
            )
        idle = not driver.tasks and not driver.timers and (app is None or not app.admission.held)
        if idle and model.up and model.in_flight == 0:
            break


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    scenario = load_scenario(DEFAULT_SCENARIO)
    if args.profile and args.profile != scenario.profile:
        scenario = scenario.model_copy(update={"profile": args.profile})
    speed = args.speed or DEFAULT_SPEED
    try:
        policy = load_policy_file(args.policy or scenario.policy_path(DEFAULT_SCENARIO.parent))
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"sglang-sidecar demo: {scenario.description}")
    print(
        f"  engine emulator: profile {scenario.profile}, {speed:g}x real time; policy {policy.policy.name}; "
        f"times below are engine seconds\n"
    )
    cuda = bool(getattr(args, "cuda", False))
    if cuda:
        print(
            "  --cuda: the pool and every prefill transient are real device memory; the sidecar reads NVML\n"
        )
    print("1) straight at the engine, no gate")
    ungated = asyncio.run(run_phase(scenario, None, speed, args.seed, "no gate", WINDOW_S, cuda=cuda))
    print("\n2) the same traffic through the sidecar")
    gated = asyncio.run(
        run_phase(scenario, scale_policy(policy, speed), speed, args.seed, "gated", WINDOW_S, cuda=cuda)
    )
    results = {"without the gate": ungated, f"with the gate ({policy.policy.name})": gated}
    print()
    print(
        format_table(results)
        .replace("TTFT p50 (completed)", "TTFT p50 (engine s)")
        .replace("TTFT p99 (completed)", "TTFT p99 (engine s)")
    )
    for c in ungated["crashes"]:
        print(f"\nwithout the gate the engine died at t={c['t']:.0f}s: {c['reason']}")
    if gated["crashes"]:
        print("\nTHE GATED ENGINE CRASHED: the policy let through what the engine could not hold.")
    else:
        print(
            f"with the gate: no crash; every request ended admitted or answered with its reason (a 429 + Retry-After when it may come back, a 413 when it never fits); "
            f"ledger at end: {gated['ledger_at_end']}"
        )
    print(
        f"\n({time.monotonic() - started:.0f} s wall. Replay it in virtual time: sglang-sidecar replay "
        f"scenarios/{DEFAULT_SCENARIO.name} --plot outage.png)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 1 if gated["crashes"] else 0
