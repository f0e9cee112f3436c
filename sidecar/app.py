"""Wiring: the ASGI application that puts the proxy, the admin endpoints and the pollers together.

The top-level app is plain ASGI and routes by exact path: gated generation paths and everything
unknown go to the proxy, the sidecar's own few paths to a small FastAPI app. Pollers run as tasks
started in the lifespan and feed new snapshots to the admission controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from sidecar.admin import ADMIN_PATHS, build_admin
from sidecar.admission import Admission
from sidecar.core import demand
from sidecar.core.snapshot import EngineSignals, GpuSignals, SourceHealth
from sidecar.observe import StateCollector, Telemetry, register_process_metrics
from sidecar.policy import LoadedPolicy, PolicyError
from sidecar.policy_source import PolicySource
from sidecar.proxy import Proxy, Receive, Scope, Send, error_body, make_session, send_response
from sidecar.routes import RouteTable, normalize_path
from sidecar.signals.engine import EngineScraper, make_control_client
from sidecar.signals.gpu import GpuPoller, GpuSource
from sidecar.tokens import CounterConfig, PromptCounter, TokenizerLoadError

log = logging.getLogger("sidecar")


class SidecarApp:
    def __init__(
        self,
        *,
        upstream: str,
        policy: LoadedPolicy,
        gpu_source: GpuSource | None,
        mode_shadow: bool = False,
        admin_token: str | None = None,
        policy_path: str | None = None,
        decision_log: Any = None,
        max_connections: int = 1024,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 1800.0,
        trust_emulator_sizes: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.clock = clock
        self.gpu_source = gpu_source
        self.policy_path = policy_path
        self.registry = CollectorRegistry()
        self.telemetry = Telemetry(self.registry, decision_log, shadow=mode_shadow)
        register_process_metrics(self.registry)
        self.admission = Admission(policy, clock, shadow=mode_shadow, observer=self.telemetry)
        self.telemetry.context = self._log_context
        self.counter = PromptCounter(self._counter_config(), engine_tokenize=self._engine_tokenize)
        self.trust_emulator_sizes = trust_emulator_sizes
        self.proxy = Proxy(
            self.upstream,
            self.admission,
            self.counter,
            chunk_hint=self._chunk_hint,
            on_first_byte=self.telemetry.first_byte,
            trust_declared_sizes=trust_emulator_sizes,
        )
        self.routes = RouteTable(policy.policy.gated_paths)
        self.policy_source = PolicySource(
            policy_path, self.apply_policy, lambda: self.admission.loaded, self.telemetry.policy_reload
        )
        self.admin = build_admin(self, admin_token)
        self.registry.register(
            StateCollector(self.admission, clock, self.gate_open, lambda: self.telemetry.dropped_log_lines)
        )
        self._limits = (max_connections, connect_timeout_s, read_timeout_s)
        self._tasks: list[asyncio.Task[None]] = []
        self.control: httpx.AsyncClient | None = None
        self.scraper: EngineScraper | None = None
        self.gpu_poller: GpuPoller | None = None

    # -- ASGI -------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            # Every variant the engine would route to a prefill route is gated (`/generate/`, `//generate`).
            route = self.routes.match(path, scope["method"])
            if route is not None:
                await self.proxy(scope, receive, send, gated=True, route=route)
            elif path in ADMIN_PATHS:
                await self.admin(scope, receive, send)
            elif normalize_path(path) in self.routes.refused:
                await send_response(send, _refused(path))
            else:
                await self.proxy(scope, receive, send, gated=False)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:
                    await self.shutdown()
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        policy = self.admission.policy
        if self.gpu_source is not None:
            self.gpu_poller = GpuPoller(
                self.gpu_source, interval_s=policy.gpu.poll_interval_s, clock=self.clock
            )
            # Fail at start-up, loudly, when the configured GPU source cannot be read at all.
            first = await self.gpu_poller.check()
            self._on_gpu(first, SourceHealth(last_ok_at=self.clock()))
        self.control = make_control_client(timeout_s=5.0)
        self.proxy.session = make_session(*self._limits)
        self.scraper = EngineScraper(
            self.upstream, client=self.control, interval_s=policy.engine.poll_interval_s, clock=self.clock
        )
        self._tasks.append(asyncio.create_task(self.scraper.run(self._on_engine), name="engine-scraper"))
        if self.gpu_poller is not None:
            self._tasks.append(asyncio.create_task(self.gpu_poller.run(self._on_gpu), name="gpu-poller"))
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_from_file)

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self.proxy.session is not None:
            await self.proxy.session.close()
        if self.control is not None:
            await self.control.aclose()
        if self.gpu_source is not None:
            await self.gpu_source.aclose()
        self.telemetry.close()

    # -- signals ----------------------------------------------------------------------------------

    def _on_engine(self, signals: EngineSignals | None, health: SourceHealth) -> None:
        snap = self.admission.snapshot
        self.admission.update_snapshot(replace(snap, engine=signals or snap.engine, engine_health=health))

    def _on_gpu(self, signals: GpuSignals | None, health: SourceHealth) -> None:
        snap = self.admission.snapshot
        self.admission.update_snapshot(replace(snap, gpu=signals or snap.gpu, gpu_health=health))

    def _chunk_hint(self) -> int | None:
        e = self.admission.snapshot.engine
        return e.chunked_prefill_size if e else None

    async def _engine_tokenize(self, payload: dict[str, Any]) -> int | None:
        assert self.control is not None
        r = await self.control.post(self.upstream + "/tokenize", json=payload, timeout=30.0)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return int(r.json()["count"])

    def _counter_config(self, loaded: LoadedPolicy | None = None) -> CounterConfig:
        return CounterConfig(**(loaded or self.admission.loaded).policy.prompt.model_dump())

    # -- state ------------------------------------------------------------------------------------

    def gate_open(self) -> bool:
        """Would a minimal request be admitted right now (and nobody is waiting ahead of it)?"""
        if self.admission.held:
            return False
        probe = demand.build(self.admission.rules, 1, arrived_at=self.clock())
        return self.admission.evaluate(probe).admitted

    def _log_context(self) -> dict[str, Any]:
        snap, now = self.admission.snapshot, self.clock()
        e, g = snap.engine, snap.gpu
        return {
            "policy": self.admission.policy.name,
            "mode": "shadow" if self.admission.shadow else "enforce",
            "held": self.admission.held,
            "engine": None
            if e is None
            else {
                "running": e.running_requests,
                "queue": e.queue_requests,
                "full_usage": e.full_token_usage,
                "mamba_usage": e.mamba_usage,
                "pending_prefill_tokens": e.pending_prefill_tokens,
                "age_s": _round(snap.engine_age(now)),
            },
            "gpu": None if g is None else {"free_bytes": g.free_bytes, "age_s": _round(snap.gpu_age(now))},
        }

    # -- policy -----------------------------------------------------------------------------------

    def reload_from_file(self) -> None:
        """SIGHUP. Logged, recorded and counted by the policy source, like an upload."""
        self.policy_source.reload_file()

    def apply_policy(self, loaded: LoadedPolicy) -> None:
        """Swap the policy; a tokenizer that fails to load refuses the whole policy (raises PolicyError)."""
        try:
            self.counter.config = self._counter_config(loaded)
        except TokenizerLoadError as e:
            raise PolicyError(loaded.path or "<policy>", [f"prompt.tokenizer_path: {e}"]) from None
        self.admission.reload(loaded)
        self.routes = RouteTable(loaded.policy.gated_paths)
        # Pollers read their interval before each sleep: the new cadence applies from the next poll.
        if self.scraper is not None:
            self.scraper.interval_s = loaded.policy.engine.poll_interval_s
        if self.gpu_poller is not None:
            self.gpu_poller.interval_s = loaded.policy.gpu.poll_interval_s


def _refused(path: str) -> tuple[int, list, bytes]:
    return error_body(
        403,
        f"{path} prefills a body the sidecar cannot size (a file upload); send the request to "
        "/generate with input_embeds instead",
        "route_not_gated",
    )


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
