"""Wiring: the ASGI application that puts the proxy, the admin endpoints and the pollers together.

The top-level app is plain ASGI and routes by exact path: gated generation paths and everything
unknown go to the proxy, the probes to a small FastAPI app. The admin endpoints are a second ASGI app,
:attr:`SidecarApp.admin_asgi`, served on its own listener (``--admin-listen``); on the data port their
paths answer 404 saying where they moved, unless ``admin_on_data_port`` keeps the old layout. Pollers
run as tasks started in the data app's lifespan and feed new snapshots to the admission controller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from sidecar.admission.clock import LoopClock
from sidecar.admission.controller import Admission
from sidecar.core import demand
from sidecar.core.snapshot import EngineSignals, GpuSignals, Snapshot, SourceHealth
from sidecar.http.access_log import AccessLog
from sidecar.http.answers import Response, error_response, invalid_request, json_response, send_response
from sidecar.http.asgi import ASGIApp, Message, Receive, Scope, Send
from sidecar.http.hosts import LOCAL_NAMES_ONLY, HostCheck
from sidecar.http.proxy import ClientGone, Proxy, make_session, read_body
from sidecar.intake.body import BadRequest
from sidecar.intake.tokens import CounterConfig, PromptCounter, TokenizerLoadError
from sidecar.ops import learned_file
from sidecar.ops.admin import ADMIN_PATHS, PROBE_PATHS, build_admin
from sidecar.ops.loads import LOADS_PATH, LoadsEndpoint
from sidecar.ops.telemetry import (
    LogCapture,
    SnapshotContext,
    StateCollector,
    Telemetry,
    context_fragments,
    register_process_metrics,
)
from sidecar.policy.engine_routes import RouteTable, control_route, normalize_path
from sidecar.policy.schema import LoadedPolicy, PolicyError
from sidecar.policy.source import PolicySource
from sidecar.settings import EXIT_NOT_STARTED
from sidecar.signals.engine import (
    IDLE_ENGINE_POLL_S,
    IDLE_GPU_POLL_S,
    EngineScraper,
    Sooner,
    idle_poll_interval,
    make_control_client,
)
from sidecar.signals.gpu import GpuPoller, GpuSource

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
        upstream_client: str = "lean",
        trust_emulator_sizes: bool = False,
        admin_on_data_port: bool = False,
        host_check: HostCheck | None = None,
        admin_host_check: HostCheck | None = LOCAL_NAMES_ONLY,
        policy_watch_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        state_file: Path | None = None,
    ) -> None:
        """``host_check``: the Host values the data port answers (None: any); ``admin_host_check``:
        the admin port's (by default IP literals and localhost only: no DNS rebinding);
        ``policy_watch_s``: how often the policy file is looked at for a change (0: only on SIGHUP)."""
        self.policy_watch_s = policy_watch_s
        self.upstream = upstream.rstrip("/")
        self.clock = clock
        self.gpu_source = gpu_source
        self.policy_path = policy_path
        self.registry = CollectorRegistry()
        self.telemetry = Telemetry(self.registry, decision_log, shadow=mode_shadow)
        register_process_metrics(self.registry)
        self.admission = Admission(policy, LoopClock(clock), shadow=mode_shadow, observer=self.telemetry)
        if state_file is not None:
            # What earlier runs learned (margins, the engine build, an unconfirmed build and since when),
            # kept as it changes (ops/learned_file); a file it cannot use raises StateFileError.
            learned_file.keep(state_file, self.admission.watch, clock)
            self.admission.refresh_rules()  # the rules in force with what was restored
        self._context_cache: SnapshotContext | None = None
        self.telemetry.capture = self._log_capture
        self.counter = PromptCounter(_counter_config(policy), engine_tokenize=self._engine_tokenize)
        self.trust_emulator_sizes = trust_emulator_sizes
        self.proxy = Proxy(
            self.upstream,
            self.admission,
            self.counter,
            on_first_byte=self.telemetry.first_byte,
            trust_declared_sizes=trust_emulator_sizes,
        )
        self.routes = _route_table(policy)
        self.admin_token = admin_token
        self.policy_source = PolicySource(
            policy_path, self.apply_policy, lambda: self.admission.loaded, self.telemetry.policy_reload
        )
        self.admin = build_admin(self, admin_token)
        # The data port's probes (and, with admin_on_data_port, the old layout), naming no file or URL.
        self.public = build_admin(self, admin_token, public=True)
        self.admin_on_data_port = admin_on_data_port
        self.host_check, self.admin_host_check = host_check, admin_host_check
        # Routers poll /v1/loads from the worker URL (this port): answered with the sidecar's work added.
        self.loads = LoadsEndpoint(self.upstream, lambda: self.admission)
        # One access-log line per request; its in-flight count is what a drain waits for. The admin
        # port logs too, but a drain does not wait for a slow scrape.
        self.access = AccessLog(self._http, clock)
        self._admin_access = AccessLog(self._admin_http, clock)
        self.registry.register(
            StateCollector(self.admission, clock, self.gate_open, lambda: self.telemetry.dropped_log_lines)
        )
        self._limits = (max_connections, connect_timeout_s, read_timeout_s)
        self._upstream_client = upstream_client
        self._tasks: list[asyncio.Task[None]] = []
        self.control: httpx.AsyncClient | None = None
        # The engine's /tokenize (opt-in) gets its own pool: a burst of long prompts must not queue
        # the /metrics scraper behind it into stale signals.
        self.tokenize_client: httpx.AsyncClient | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._model_paths_tried: tuple[str, ...] = ()
        self._loop: asyncio.AbstractEventLoop | None = None  # set at start-up; policy swaps run on it
        self.scraper: EngineScraper | None = None
        self.gpu_poller: GpuPoller | None = None

    # -- ASGI -------------------------------------------------------------------------------------

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The data port (and the lifespan: pollers start and stop with it).

        Not a coroutine: it returns the handler's own awaitable, so a request's task is not one frame
        deeper for it (a stream resumes its whole chain of frames for every chunk; issue #12). Served
        as ASGI 3 explicitly (uvicorn cannot tell from a plain method)."""
        if scope["type"] == "http":
            return self.access(scope, receive, send)
        if scope["type"] == "lifespan":
            return self._lifespan(receive, send)
        return _nothing()

    async def admin_asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The admin port. Serve it with ``lifespan="off"``: the data app's lifespan runs the pollers."""
        if scope["type"] == "http":
            await self._admin_access(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _no_lifespan(receive, send)

    def _http(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """Route one request: the chosen handler's awaitable (no frame of its own, as ``__call__``)."""
        if self.host_check is not None and (refusal := self.host_check.refusal(scope["headers"])):
            return send_response(send, refusal)
        path = scope["path"]
        if not path.startswith("/"):
            # `OPTIONS *` (or an absolute-form target): not a path any route serves.
            return send_response(send, _not_a_path(scope))
        # Every variant the engine would route to a prefill route is gated (`/generate/`, `//generate`).
        route = self.routes.match(path, scope["method"])
        if route is not None:
            return self.proxy(scope, receive, send, gated=True, route=route)
        if scope["method"] == "OPTIONS" and (route := self.routes.match(path, "POST")) is not None:
            # A CORS preflight: answered here, approving no origin. SGLang's own CORS allows every
            # origin, which would let any web page POST JSON to the lane through the sidecar.
            return send_response(send, _no_cors(route.methods))
        if path in PROBE_PATHS:
            return self.public(scope, receive, send)
        if path in ADMIN_PATHS:
            if not self.admin_on_data_port:
                return send_response(send, _on_admin_port(path))
            return _with_bounded_body(self.public, scope, receive, send)
        if scope["method"] == "GET" and normalize_path(path) == LOADS_PATH:
            return self.loads(scope, receive, send)
        if normalize_path(path) in self.routes.refused:
            return send_response(send, _refused(path))
        if (control := self.routes.closed(path)) is not None:
            return send_response(send, _control_closed(control))
        return self.proxy(scope, receive, send, gated=False)

    async def _admin_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.admin_host_check is not None and (refusal := self.admin_host_check.refusal(scope["headers"])):
            await send_response(send, refusal)
            return
        if scope["path"] not in ADMIN_PATHS and control_route(scope["path"]) is not None:
            await self._relay_control(scope, receive, send)
            return
        await _with_bounded_body(self.admin, scope, receive, send)

    async def _relay_control(self, scope: Scope, receive: Receive, send: Send) -> None:
        """An engine control route on the admin port: relayed to the engine with the admin bearer token,
        as a policy upload is (403 without --admin-token-file, 401 without the token). The token is
        the sidecar's: it is not sent on to the engine."""
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "unknown client"
        if self.admin_token is None:
            log.warning("engine control route %s from %s refused (403): no admin token", scope["path"], who)
            await send_response(
                send, error_response(403, "engine control routes need --admin-token-file", "disabled")
            )
            return
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not hmac.compare_digest(auth, b"Bearer " + self.admin_token.encode()):
            log.warning("engine control route %s from %s refused (401): bad token", scope["path"], who)
            await send_response(send, error_response(401, "missing or wrong bearer token", "unauthorized"))
            return
        log.info(
            "engine control route %s %s relayed for %s",
            scope["method"],
            scope["path"],
            who,
            extra={"fields": {"event": "control_route", "path": scope["path"], "client": who}},
        )
        headers = [(k, v) for k, v in scope["headers"] if k != b"authorization"]
        await self.proxy({**scope, "headers": headers}, receive, send, gated=False)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:
                    # Said once, by the sidecar's own logger in the chosen format (not uvicorn's).
                    log.error(
                        "start-up failed: %s",
                        e,
                        extra={"fields": {"event": "startup_failed", "exit_code": EXIT_NOT_STARTED}},
                    )
                    await self.shutdown()
                    await send({"type": "lifespan.startup.failed", "message": ""})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Which loop runs the data path is a performance fact (uvloop costs it about half the stdlib
        # loop's CPU per request), so the log says it once.
        kind = type(self._loop)
        loop_name = f"{kind.__module__}.{kind.__qualname__}"
        log.info("event loop %s", loop_name, extra={"fields": {"event": "event_loop", "loop": loop_name}})
        policy, rules = self.admission.policy, self.admission.rules
        if self.gpu_source is not None:
            self.gpu_poller = GpuPoller(
                self.gpu_source, interval_s=rules.gpu.poll_interval_s, clock=self.clock
            )
            # Fail at start-up, loudly, when the configured GPU source cannot be read at all.
            first = await self.gpu_poller.check()
            # None: a file not written yet; the poller says so, once, and the signal is stale.
            if first is not None:
                self._on_gpu(first, SourceHealth(last_ok_at=self.clock()))
        self.control = make_control_client(timeout_s=5.0)
        self.proxy.session = make_session(*self._limits, upstream=self.upstream, client=self._upstream_client)
        self.scraper = EngineScraper(
            self.upstream,
            client=self.control,
            interval_s=rules.engine.poll_interval_s,
            clock=self.clock,
            max_metrics_bytes=policy.engine.max_metrics_bytes,
        )
        self.scraper.on_implausible = lambda series: self.telemetry.implausible("engine", series)
        # A new engine process: its idle free memory is measured again (vram.idle_free_bytes: auto).
        self.scraper.on_engine_changed = self.admission.engine_restarted
        # While a request is held after an admitted one ended, both are read sooner than their intervals
        # (policy engine.poll_after_release_s; Admission.report_wanted, signals.engine.Sooner).
        self.scraper.sooner = self._sooner()
        # While the gate is idle the signals are read less often; a request's arrival wakes the pollers.
        self.scraper.idle = self.admission.quiet
        if self.gpu_poller is not None:
            self.gpu_poller.sooner = self._sooner()
            self.gpu_poller.idle = self.admission.quiet
        self._idle_intervals()
        self.admission.on_busy = self._report_wanted
        self.admission.on_report_wanted = self._report_wanted
        self._tasks.append(asyncio.create_task(self.scraper.run(self._on_engine), name="engine-scraper"))
        if self.gpu_poller is not None:
            self._tasks.append(asyncio.create_task(self.gpu_poller.run(self._on_gpu), name="gpu-poller"))
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGHUP, lambda: self._spawn(self.reload_from_file(), "policy-reload")
            )
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            # logrotate renamed the decision log: the next batch goes to a new file at its path.
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self.telemetry.reopen_decision_log)
        if self.policy_path is not None and self.policy_watch_s > 0:
            self._tasks.append(asyncio.create_task(self._watch_policy(), name="policy-watch"))

    async def drain(self, timeout_s: float) -> bool:
        """SIGTERM: stop admitting (new and held requests get 503 ``draining``, ``/readyz`` fails) while
        the listener stays open, and wait up to ``timeout_s`` for in-flight requests to finish. True
        when they all did. Both ends are logged: an SRE reading a restart wants to know what it cut."""
        started = self.clock()
        held = self.admission.held
        self.admission.drain()
        log.info(
            "drain started: %d requests in flight, %d held (rejected with draining); up to %g s to finish",
            self.access.in_flight,
            held,
            timeout_s,
            extra={"fields": {"event": "drain_start", "in_flight": self.access.in_flight, "held": held}},
        )
        try:
            await asyncio.wait_for(self.access.wait_idle(), timeout_s)
            finished = True
        except TimeoutError:
            finished = False
        left = self.access.in_flight
        log.log(
            logging.INFO if finished else logging.WARNING,
            "drain ended after %.1f s: %s",
            self.clock() - started,
            "every in-flight request finished" if finished else f"{left} still in flight, to be cut",
            extra={
                "fields": {
                    "event": "drain_end",
                    "seconds": round(self.clock() - started, 3),
                    "in_flight": left,
                    "finished": finished,
                }
            },
        )
        return finished

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for t in list(self._background):
            t.cancel()
        if self.proxy.session is not None:
            await self.proxy.session.close()
        if self.control is not None:
            await self.control.aclose()
        if self.tokenize_client is not None:
            await self.tokenize_client.aclose()
        await self.loads.aclose()
        if self.gpu_source is not None:
            await self.gpu_source.aclose()
        self.telemetry.close()

    # -- signals ----------------------------------------------------------------------------------

    def _sooner(self) -> Sooner:
        a = self.admission
        return Sooner(a.report_wanted, lambda: a.rules.engine.poll_after_release_s)

    def _idle_intervals(self) -> None:
        rules = self.admission.rules
        if self.scraper is not None:
            e = rules.engine
            self.scraper.idle_interval_s = idle_poll_interval(
                e.poll_interval_s, e.max_age_s, IDLE_ENGINE_POLL_S
            )
        if self.gpu_poller is not None:
            g = rules.gpu
            self.gpu_poller.idle_interval_s = idle_poll_interval(
                g.poll_interval_s, g.max_age_s, IDLE_GPU_POLL_S
            )

    def _report_wanted(self) -> None:
        for poller in (self.scraper, self.gpu_poller):
            if poller is not None and poller.sooner is not None:
                poller.sooner.nudge()

    def _on_engine(self, signals: EngineSignals | None, health: SourceHealth) -> None:
        snap = self.admission.snapshot
        known = snap.engine.version if snap.engine else None
        if signals is not None and known is not None and signals.version not in (None, known):
            # A new engine build may serve /tokenize where the old one answered 404: ask it again.
            self.counter.reset_engine_tokenize()
        self.admission.update_snapshot(replace(snap, engine=signals or snap.engine, engine_health=health))
        self._adopt_engine_tokenizer()

    def _adopt_engine_tokenizer(self) -> None:
        """Count with the engine's own model's tokenizer.json when the policy names none (off the loop)."""
        config = self.counter.config
        paths = self.scraper.model_paths if self.scraper is not None else ()
        if not paths or paths == self._model_paths_tried:
            return
        if config.tokenizer_path is not None or not config.tokenizer_from_engine:
            return
        self._model_paths_tried = paths
        self._spawn(self.counter.adopt_engine_model(paths), "tokenizer-load")

    def _spawn(self, work: Any, name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_gpu(self, signals: GpuSignals | None, health: SourceHealth) -> None:
        snap = self.admission.snapshot
        self.admission.update_snapshot(replace(snap, gpu=signals or snap.gpu, gpu_health=health))

    async def _engine_tokenize(self, payload: dict[str, Any]) -> int | None:
        if self.tokenize_client is None:
            self.tokenize_client = make_control_client(timeout_s=30.0, max_connections=16)
        r = await self.tokenize_client.post(self.upstream + "/tokenize", json=payload)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return int(r.json()["count"])

    # -- state ------------------------------------------------------------------------------------

    def gate_open(self) -> bool:
        """Would a minimal request be admitted right now (and nobody is waiting ahead of it)?"""
        if self.admission.held:
            return False
        probe = demand.build(self.admission.rules, 1, arrived_at=self.clock())
        return self.admission.evaluate(probe).admitted

    def _log_capture(self) -> LogCapture:
        """The decision log's view of the lane at this decision, taken by value for its line to be
        written later (``telemetry.render_decision``): what a snapshot carries, kept once per snapshot
        (``_snapshot_parts``: its dicts and their JSON), the held count and the signals' ages now."""
        a = self.admission
        snap, now = a.snapshot, self.clock()
        cached = self._context_cache
        if cached is None or cached[0] is not snap or cached[1] is not a.loaded or cached[2] != a.shadow:
            cached = self._snapshot_parts(a, snap)
        e, g = snap.engine, snap.gpu
        return (
            cached,
            a.held,
            None if e is None else now - e.observed_at,
            None if g is None else now - g.observed_at,
        )

    def _snapshot_parts(self, a: Admission, snap: Snapshot) -> SnapshotContext:
        """The context's parts that change only with a snapshot or the policy, kept (with what they
        were taken from) until either changes: one cache for both ways, the dicts and their JSON
        (``telemetry.context_fragments``)."""
        head, engine, gpu = _snapshot_context(a, snap)
        cached = (snap, a.loaded, a.shadow, head, engine, gpu, context_fragments(head, engine, gpu))
        self._context_cache = cached
        return cached

    # -- policy -----------------------------------------------------------------------------------

    async def reload_from_file(self) -> None:
        """SIGHUP. Logged, recorded and counted by the policy source, like an upload; the file and the
        tokenizer are read in a worker thread (see :meth:`apply_policy`)."""
        await asyncio.to_thread(self.policy_source.reload_file)

    async def _watch_policy(self) -> None:
        """The mounted policy file, looked at every ``policy_watch_s``: a ConfigMap update or an edit
        applies without a signal (no reloader container, no shared process namespace). The look and
        a reload run in a worker thread, as SIGHUP's do."""
        while True:
            await asyncio.to_thread(self.policy_source.reload_if_changed)
            await asyncio.sleep(self.policy_watch_s)

    def apply_policy(self, loaded: LoadedPolicy) -> None:
        """Swap the policy; a tokenizer that fails to load refuses the whole policy (raises PolicyError).

        The policy source calls this from a worker thread (SIGHUP, upload): the tokenizer is loaded
        there, before anything changes, and only the swap runs on the event loop, so requests keep
        flowing under the old policy meanwhile. Called on the loop itself (tests, embedding), it does
        both in place.
        """
        config = _counter_config(loaded)
        try:
            tokenizer = self.counter.load_for(config)
        except TokenizerLoadError as e:
            raise PolicyError(loaded.path or "<policy>", [f"prompt.tokenizer_path: {e}"]) from None
        loop = self._loop
        if loop is None or _running_loop() is loop:
            self._swap_policy(loaded, config, tokenizer)
        else:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()

            def swap() -> None:
                try:
                    self._swap_policy(loaded, config, tokenizer)
                    done.set_result(None)
                except BaseException as exc:
                    done.set_exception(exc)

            loop.call_soon_threadsafe(swap)
            done.result(timeout=60)

    def _swap_policy(self, loaded: LoadedPolicy, config: CounterConfig, tokenizer: Any) -> None:
        self.counter.swap(config, tokenizer)
        self.admission.reload(loaded)
        self.routes = _route_table(loaded)
        # Pollers read their interval before each sleep: the new cadence applies from the next poll.
        if self.scraper is not None:
            self.scraper.interval_s = self.admission.rules.engine.poll_interval_s
            self.scraper.max_metrics_bytes = loaded.policy.engine.max_metrics_bytes
        if self.gpu_poller is not None:
            self.gpu_poller.interval_s = self.admission.rules.gpu.poll_interval_s
        self._idle_intervals()


# explain and policy uploads are small: a generation body to explain is a question, not a prompt to
# forward (the bare {"prompt_tokens": N} form asks about any size), and a policy is a page of YAML.
ADMIN_MAX_BODY_BYTES = 1024 * 1024


async def _bounded_admin_body(scope: Scope, receive: Receive, send: Send) -> Receive | None:
    """Read an admin POST body up to ``ADMIN_MAX_BODY_BYTES`` (413 past it, nothing buffered beyond),
    then hand it to the admin app as one message; None when the request was answered or the client left."""
    try:
        body = await read_body(
            scope,
            receive,
            ADMIN_MAX_BODY_BYTES,
            source='the admin endpoints\' limit; explain any size with {"prompt_tokens": N}',
        )
    except BadRequest as e:
        await send_response(send, json_response(e.status, invalid_request(e)))
        return None
    except ClientGone:
        return None
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _with_bounded_body(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Call an admin app with its POST/PUT body read under the admin limit first (both ports)."""
    if scope["method"] in ("POST", "PUT"):
        bounded = await _bounded_admin_body(scope, receive, send)
        if bounded is None:
            return
        receive = bounded
    await app(scope, receive, send)


async def _nothing() -> None:
    """A scope type the data port does not serve (a websocket): nothing to do."""


async def _no_lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _no_cors(methods: tuple[str, ...]) -> Response:
    return 204, [(b"allow", ", ".join((*methods, "OPTIONS")).encode())], b""


def _on_admin_port(path: str) -> Response:
    return error_response(
        404,
        f"{path} is served on the admin listener (--admin-listen, 127.0.0.1:8002 by default), not on "
        "the data port; --admin-on-data-port keeps the old layout",
        "admin_path",
    )


def _not_a_path(scope: Scope) -> Response:
    if scope["method"] == "OPTIONS" and scope["path"] == "*":
        return 204, [(b"allow", b"GET, HEAD, POST, PUT, OPTIONS")], b""
    return error_response(400, "the request target must be a path starting with /", "invalid_target")


def _control_closed(route: str) -> Response:
    return error_response(
        403,
        f"{route} is one of SGLang's control routes: closed on the data port. An operator reaches it on "
        "the admin port with the admin token; a policy opens it here with routes.open",
        "engine_control_route",
    )


def _route_table(loaded: LoadedPolicy) -> RouteTable:
    p = loaded.policy
    return RouteTable(p.gated_paths, open_control=p.routes.open)


def _refused(path: str) -> Response:
    return error_response(
        403,
        f"{path} prefills a body the sidecar cannot size (a file upload); send the request to "
        "/generate with input_embeds instead",
        "route_not_gated",
    )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _counter_config(loaded: LoadedPolicy) -> CounterConfig:
    return CounterConfig(**loaded.policy.prompt.model_dump())


def _snapshot_context(
    a: Admission, snap: Snapshot
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """The decision log's context fields that change only with a snapshot or a policy: the head
    (policy, mode), the engine's and the GPU's fields without their ages (``telemetry.context_dict`` adds them),
    None for a signal not read."""
    e, g = snap.engine, snap.gpu
    head = {"policy": a.policy.name, "mode": "shadow" if a.shadow else "enforce"}
    engine = None if e is None else {
        "running": e.running_requests,
        "queue": e.queue_requests,
        "full_usage": e.full_token_usage,
        "mamba_usage": e.mamba_usage,
        "pending_prefill_tokens": e.pending_prefill_tokens,
    }  # fmt: skip
    gpu = None if g is None else {"free_bytes": g.free_bytes}
    return head, engine, gpu
