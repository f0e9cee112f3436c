"""`sglang-sidecar` (also `python -m sidecar`): serve, check-policy, status, init, demo, emulate, replay.

argparse gives the command structure and --help; `serve`'s options are validated by the pydantic
Settings model, which also reads each option from its ``SIDECAR_*`` environment variable.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from sidecar import __version__
from sidecar.http.server import ServingLimits, uvicorn_options
from sidecar.policy.schema import PolicyError, load_policy_file
from sidecar.settings import EXIT_NOT_STARTED, EXIT_USAGE

# What a script or a service manager can act on; `--help` prints it.
EXIT_STATUS = (
    "exit status: 0 done (serve: stopped by SIGTERM after its drain; check-policy: valid); "
    "1 the check failed (wait: not ready in time; demo: the gated engine crashed); "
    "2 usage: an invalid flag, environment variable, policy (file:line: field: problem), GPU source or "
    "state file; "
    "3 valid but not started or nothing to show (serve: the GPU source cannot be read or a port is "
    "taken, the reason logged in --log-format; calibrate: nothing proposed); "
    "141 the reader of standard output left (a closed pipe)."
)


def _serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """One flag per Settings field, with its environment variable and default in the help."""
    from sidecar.settings import Settings

    p = sub.add_parser(
        "serve",
        help="run the admission proxy in front of one SGLang server",
        description="Run the admission proxy. Every option can also be set by its environment variable "
        "(shown in brackets); a flag wins over the environment.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="GPU sources: nvml (all devices) | nvml:<uuid>[,<uuid>...] | dcgm:<url of dcgm-exporter "
        '/metrics>[#<uuid>,...] | file:<path to {"free_bytes":N,"total_bytes":N}>\n'
        "Ports: --listen serves clients (the engine's paths, /healthz, /readyz); --admin-listen serves "
        "/admission/* and /metrics (SECURITY.md).\n"
        "Reload the policy with SIGHUP or POST /admission/policy on the admin port (bearer token; "
        "written to the policy file); a changed policy file is applied within --policy-watch-s. SIGUSR1 "
        "reopens --decision-log (after logrotate renamed it). SIGTERM drains: /readyz says 503 draining, in-flight requests finish, then the listener closes. A second "
        "SIGTERM exits at once.\n"
        "Exit status: 0 stopped by SIGTERM after the drain; 2 invalid flags, environment, policy, GPU source "
        "spec, token file or state file (nothing started); 3 could not start: the GPU source cannot be read, or a port "
        "is taken (the reason is logged, in --log-format, with event=startup_failed).",
    )
    for name, field in Settings.model_fields.items():
        kwargs: dict[str, Any] = {}
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        choices = _choices(field.annotation)
        if field.annotation is bool:
            kwargs["action"] = "store_true"
            kwargs["default"] = None  # unset: the environment or the default decides
        elif choices:
            kwargs["choices"] = choices
        else:
            kwargs["metavar"] = extra.get("metavar") or name.upper()
            if field.annotation in (int, float):
                kwargs["type"] = field.annotation
        if field.is_required():
            default = "required"
        elif field.default is None:
            default = "none"
        else:
            default = f"default {getattr(field.default, 'value', field.default)}"
            if field.annotation is bool:
                default = "default on" if field.default else "default off"
        env = f"SIDECAR_{name.upper()}"
        p.add_argument(
            "--" + name.replace("_", "-"), help=f"{field.description} ({default}) [{env}]", **kwargs
        )


def _choices(annotation: object) -> list[str] | None:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [m.value for m in annotation]
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return None


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says its default itself or has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and default is not None
            and default is not False
            and default != argparse.SUPPRESS
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-sidecar",
        description="Admission control for SGLang: hold or reject the requests that would push the engine "
        "out of GPU memory, Mamba slots or its queue.",
        epilog=EXIT_STATUS[0].upper()
        + EXIT_STATUS[1:]
        + " `sglang-sidecar COMMAND --help` for each command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)

    c = sub.add_parser(
        "check-policy",
        help="validate a policy file (exit 0 valid, 2 invalid) and say what it will do",
        formatter_class=DefaultsShown,
    )
    c.add_argument("file", metavar="FILE", help="the policy YAML")
    c.add_argument(
        "--upstream",
        metavar="URL",
        help="also compare the policy's lane facts with a live SGLang server (exit 1 when they disagree)",
    )
    c.add_argument(
        "--gpu-source",
        metavar="SPEC",
        help="with --upstream: where its GPU free memory is read (nvml, nvml:<uuid>, dcgm:<url>, file:<path>)",
    )

    d = sub.add_parser(
        "demo",
        help="emulator + sidecar on loopback: the outage, with and without the gate",
        formatter_class=DefaultsShown,
    )
    d.add_argument("--profile", default="maxq-old", help="emulator lane profile")
    d.add_argument("--policy", default=None, help="policy for the gated run (default: the profile's)")
    d.add_argument(
        "--speed", type=float, default=None, help="emulator time speed-up factor (default: the demo's own)"
    )
    d.add_argument("--seed", type=int, default=7, help="seed of the workload and the model's noise")
    d.add_argument("--json", metavar="OUT", help="also write the summary as JSON")
    d.add_argument(
        "--cuda", action="store_true", help="real GPU memory (PyTorch) and real NVML instead of the model"
    )

    e = sub.add_parser(
        "emulate", help="run the SGLang-compatible engine emulator as a server", formatter_class=DefaultsShown
    )
    e.add_argument("--profile", default="maxq-old", help="lane profile (see --list-profiles)")
    e.add_argument("--listen", default="127.0.0.1:30000", metavar="HOST:PORT", help="address to listen on")
    e.add_argument("--speed", type=float, default=1.0, help="engine seconds per wall second")
    e.add_argument("--gpu-file", metavar="PATH", help="publish free memory here for --gpu-source file:PATH")
    e.add_argument("--seed", type=int, default=0, help="seed of the model's noise")
    e.add_argument("--cuda", action="store_true", help="allocate the pool and transients on the real GPU")
    e.add_argument("--restart-s", type=float, default=None, help="downtime after a crash (default: profile)")
    e.add_argument(
        "--empty-cache-interval",
        type=float,
        default=None,
        metavar="S",
        help="empty the allocator cache while idle, at most every S wall seconds (SGLang's --sleep-on-idle "
        "with SGLANG_EMPTY_CACHE_INTERVAL; default: that variable, else off)",
    )
    e.add_argument("--list-profiles", action="store_true", help="list the lane profiles and exit")

    w = sub.add_parser(
        "wait",
        help="wait until a sidecar (or any URL) answers 200: for scripts that start one",
        formatter_class=DefaultsShown,
    )
    w.add_argument("url", nargs="?", default="http://127.0.0.1:8001/readyz", help="the URL to poll")
    w.add_argument("--timeout", type=float, default=60.0, metavar="S", help="give up after this long")

    st = sub.add_parser(
        "status",
        help="the live view of a running sidecar: decisions/s by reason, hold queue, headroom, alerts",
        description="Read a sidecar's admin port (/admission/state and /metrics) twice, --interval apart, "
        "and show the lane: decisions per second by reason, the hold queue, headroom against the largest "
        "projection admitted, the engine's gauges, the monitor, measured vs policy figures and the alerts "
        "that would fire. The same view is a page on the admin port: GET /admission/status.",
        formatter_class=DefaultsShown,
        epilog="Exit status: 0 shown, 1 the admin port could not be read.",
    )
    st.add_argument(
        "--admin",
        default="http://" + os.environ.get("SIDECAR_ADMIN_LISTEN", "127.0.0.1:8002"),
        metavar="URL",
        help="the sidecar's admin port (from SIDECAR_ADMIN_LISTEN when set)",
    )
    st.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    st.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between readings (rates are over it)",
    )
    st.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N views")

    from sidecar.calibrate.command import add_parser as add_calibrate
    from sidecar.calibrate.starter import add_parser as add_init

    add_init(sub, DefaultsShown)
    add_calibrate(sub, DefaultsShown)

    r = sub.add_parser(
        "replay",
        help="run a scenario or trace through a policy in virtual time",
        formatter_class=DefaultsShown,
    )
    r.add_argument("scenario", metavar="SCENARIO", help="scenario YAML, request-log JSONL or decision log")
    r.add_argument("--policy", metavar="FILE", help="policy for the gate (default: the scenario's)")
    r.add_argument("--gate", choices=["on", "off", "both"], default="both", help="run gated, ungated or both")
    r.add_argument("--profile", default=None, help="engine profile (default: the scenario's)")
    r.add_argument("--seed", type=int, default=None, help="seed (default: the scenario's)")
    r.add_argument("--json", metavar="OUT", help="write the full result as JSON")
    r.add_argument("--plot", metavar="OUT.png", help="plot memory, pools, queue and decisions over time")
    f = r.add_argument_group("a fleet behind a router (sidecar_emulator/fleet_replay.py)")
    f.add_argument(
        "--lanes",
        metavar="N|N,M|FLEET.yaml",
        help="replay a fleet: N lanes of the scenario's profile and policy, several counts to compare, or a"
        " fleet file (lanes: [{name, profile, policy, count}]) behind a model of SGLang's router",
    )
    f.add_argument(
        "--router",
        default="round_robin,least_load,fit",
        metavar="RULES",
        help="routing rules to compare: round_robin, least_load, fit (reads the sidecars' signals), random, hash",
    )
    f.add_argument(
        "--router-flags",
        choices=["defaults", "recommended", "both"],
        default="both",
        help="the router at its defaults or with the recommended flags (breaker off, /readyz checks)",
    )
    f.add_argument(
        "--gateway",
        choices=["smg", "sglang-router", "both"],
        default="both",
        help="which router to model: SGLang's model gateway (smg 1.13), sglang-router 0.3.2, or both",
    )
    f.add_argument(
        "--answers",
        choices=["policy", "router", "both"],
        default="both",
        help="the sidecars' answers as the policy says, or with the block for routers in docs/routing.md (413)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {
        "serve": _serve,
        "check-policy": _check_policy,
        "demo": _demo,
        "emulate": _emulate,
        "replay": _replay,
        "wait": _wait,
        "calibrate": _calibrate,
        "status": _status,
        "init": _init,
    }[args.command]
    try:
        return handler(args)
    except BrokenPipeError:
        # `check-policy ... | head`: the reader left; nothing more to say, and no traceback. Standard
        # output goes to /dev/null so that the interpreter's own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by it


def _fail(msg: str) -> int:
    print(f"sglang-sidecar: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _check_policy(args: argparse.Namespace) -> int:
    try:
        loaded = load_policy_file(args.file)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    from sidecar.policy.summary import render, summarize

    p = loaded.policy
    print(f"{args.file}: OK: policy {p.name!r} sha256 {loaded.sha256}")
    print(f"  gated paths: {', '.join(p.gated_paths)}")
    for line in render(summarize(p)):
        print(line)
    if args.upstream:
        return _check_lane(p, args.upstream, args.gpu_source)
    return 0


def _check_lane(policy: Any, upstream: str, gpu_spec: str | None) -> int:
    """``check-policy --upstream``: the policy's lane facts against the live lane (exit 1: they disagree)."""
    import asyncio

    from sidecar.ops.lane_check import LaneUnreadable, measure
    from sidecar.ops.lane_check import render as render_facts
    from sidecar.policy.in_force import rules_of
    from sidecar.signals.gpu import GpuSourceError, parse_gpu_source

    try:
        gpu = parse_gpu_source(gpu_spec) if gpu_spec else None
        found, notes = asyncio.run(measure(rules_of(policy), upstream, gpu))
    except (GpuSourceError, ValueError) as e:
        return _fail(f"--gpu-source: {e}")
    except LaneUnreadable as e:
        print(f"sglang-sidecar: error: the lane at {upstream} could not be read: {e}", file=sys.stderr)
        return 1
    print(f"  lane at {upstream}:")
    for line in [*render_facts(found), *(f"  {n}" for n in notes)]:
        print(line)
    return 1 if any(f.disagrees for f in found) else 0


def _serve(args: argparse.Namespace) -> int:
    from sidecar.settings import Settings

    given = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    try:
        settings = Settings(**given)
    except ValidationError as e:
        return _invalid_settings(e, given.get("log_format") or os.environ.get("SIDECAR_LOG_FORMAT"))
    from sidecar.ops.logs import setup_logging

    pipeline = setup_logging(settings.log_level, settings.log_format, max_queue=settings.log_queue_lines)
    try:
        return _serve_with(settings)
    finally:
        pipeline.stop()


def _invalid_settings(e: ValidationError, log_format: str | None) -> int:
    """Each bad setting by its flag and variable, in the file's terms (no pydantic wording); through
    the log in --log-format when that one is valid, else plainly on stderr."""
    from sidecar.ops.logs import LOG_FORMATS, installed
    from sidecar.policy.wording import humane
    from sidecar.settings import Settings

    lines = []
    for err in e.errors():
        loc, msg = humane(err, Settings)  # type: ignore[arg-type]
        name = str(loc[0]) if loc else "?"
        lines.append(f"  --{name.replace('_', '-')} [SIDECAR_{name.upper()}]: {msg}")
    message = "invalid settings (flags or SIDECAR_* environment):\n" + "\n".join(lines)
    if log_format in LOG_FORMATS:
        with installed("info", log_format):
            return _not_started(message)
    return _fail(message)


def _not_started(message: str, status: int = EXIT_USAGE) -> int:
    """A start-up failure, through the sidecar's logger in --log-format (a JSON log collector sees it
    as one more object, ``event=startup_failed``), and the exit status that says which kind."""
    logging.getLogger("sidecar").error(
        "not started: %s", message, extra={"fields": {"event": "startup_failed", "exit_code": status}}
    )
    return status


def _serve_with(settings: Any) -> int:
    try:
        loaded = load_policy_file(settings.policy)
    except PolicyError as e:
        return _not_started(str(e))
    from sidecar.signals.gpu import parse_gpu_source

    if settings.gpu_source is None:
        if loaded.policy.gpu.required:
            return _not_started(
                "no GPU source: pass --gpu-source (nvml, nvml:<uuid>, dcgm:<url>, file:<path>) or set "
                f"gpu.required: false in {settings.policy} to run without the VRAM constraint"
            )
        gpu = None
    else:
        try:
            gpu = parse_gpu_source(settings.gpu_source)
        except ValueError as e:
            return _not_started(f"--gpu-source: {e}")
    try:
        token = settings.admin_token()
    except (OSError, ValueError) as e:
        return _not_started(f"--admin-token-file: {e}")
    # A decision-log file holds one JSON object per line (replay reads it back); without one, decision
    # lines go through the log pipeline in --log-format.
    # SIGUSR1 reopens it (logrotate); --decision-log-max-bytes rolls it over (sidecar/ops/decision_file.py).
    decision_log = None
    if settings.decision_log:
        from sidecar.ops.decision_file import DecisionFile

        try:
            decision_log = DecisionFile(
                settings.decision_log, settings.decision_log_max_bytes, settings.decision_log_backups
            )
        except OSError as e:
            return _not_started(f"--decision-log: cannot open {settings.decision_log}: {e.strerror or e}")
    from sidecar.app import SidecarApp
    from sidecar.ops.learned_file import StateFileError
    from sidecar.ops.telemetry import sidecar_version

    try:
        app = SidecarApp(
            upstream=settings.upstream,
            policy=loaded,
            gpu_source=gpu,
            mode_shadow=settings.mode.value == "shadow",
            admin_token=token,
            policy_path=str(settings.policy),
            decision_log=decision_log,
            max_connections=settings.max_connections,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            read_timeout_s=settings.upstream_read_timeout_s,
            upstream_client=settings.upstream_client,
            trust_emulator_sizes=settings.trust_emulator_sizes,
            state_file=settings.state_file,
            admin_on_data_port=settings.admin_on_data_port,
            host_check=settings.host_check(),
            admin_host_check=settings.admin_host_check(),
            policy_watch_s=settings.policy_watch_s,
        )
    except StateFileError as e:  # serve --state-file: a file it cannot restore from (file: field: problem)
        return _not_started(str(e))
    logging.getLogger("sidecar").info(
        "sglang-sidecar %s starting: upstream %s, listen %s, admin %s, policy %s (sha256 %s), mode %s, "
        "gpu source %s",
        sidecar_version(),
        settings.upstream,
        settings.listen,
        settings.admin_listen + (" (and on the data port)" if settings.admin_on_data_port else ""),
        loaded.policy.name,
        loaded.sha256[:12],
        settings.mode.value,
        settings.gpu_source or "none",
        extra={
            "fields": {
                "event": "start",
                "version": sidecar_version(),
                "upstream": settings.upstream,
                "listen": settings.listen,
                "admin_listen": settings.admin_listen,
                "admin_on_data_port": settings.admin_on_data_port,
                "allowed_hosts": settings.allowed_hosts,
                "policy": loaded.policy.name,
                "policy_sha256": loaded.sha256,
                "policy_file": str(settings.policy),
                "mode": settings.mode.value,
                "gpu_source": settings.gpu_source,
                "headroom": loaded.policy.vram.headroom.value,
                "decision_log": str(settings.decision_log) if settings.decision_log else None,
            }
        },
    )
    return run_uvicorn(
        app,
        settings.host,
        settings.port,
        settings.log_level,
        settings.drain_timeout_s,
        limits=settings.serving_limits(),
        admin=(app.admin_asgi, settings.admin_host, settings.admin_port),
        forwarded_allow_ips=settings.forwarded_allow_ips,
    )


def run_uvicorn(
    app: object,
    host: str,
    port: int,
    log_level: str = "info",
    drain_timeout_s: float = 30.0,
    *,
    limits: ServingLimits | None = None,
    admin: tuple[object, str, int] | None = None,
    forwarded_allow_ips: str | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain: keep listening (``/readyz`` 503 ``draining``, new gated
    requests 503 ``draining``) while in-flight requests finish, up to ``drain_timeout_s``; only then
    close the listener. A second signal exits at once.

    ``admin``: a second app, host and port (the admin listener), served in the same event loop from
    before the data port opens until after it closes; it takes no signals of its own.
    ``forwarded_allow_ips``: the proxies trusted for ``X-Forwarded-*`` (``serving.uvicorn_options``)."""
    import contextlib

    import uvicorn

    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        lifespan="on",
        interface="asgi3",  # SidecarApp.__call__ returns its handler's awaitable: not auto-detected
        log_level=log_level,
        # Our log pipeline (sidecar.ops.logs) carries uvicorn's lines: no handlers, no access log of its own.
        log_config=None,
        access_log=False,
        # The drain already waited for in-flight requests; this is only the listener's last word.
        timeout_graceful_shutdown=2,
        # Header deadline, header size, body gap, connection cap: sidecar/http/server.py.
        **uvicorn_options(limits or ServingLimits(), forwarded_allow_ips),
    )

    class DrainingServer(uvicorn.Server):
        _loop: asyncio.AbstractEventLoop | None = None
        _draining = False

        def handle_exit(self, sig: int, frame: object) -> None:
            drain = getattr(app, "drain", None)
            if self._draining or drain is None or self._loop is None:
                super().handle_exit(sig, frame)  # type: ignore[arg-type]
                return
            self._draining = True
            loop = self._loop
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit(drain)))

        async def _drain_then_exit(self, drain: Any) -> None:
            try:
                await drain(drain_timeout_s)
            finally:
                self.should_exit = True

        async def serve(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        async def startup(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            await super().startup(sockets)
            _freeze_startup_objects()
            _prefer_the_loop()

    server = DrainingServer(config)
    if admin is None:
        server.run()
        return 0 if server.started else EXIT_NOT_STARTED

    class AdminServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            yield  # the data server's handler drains, then this one stops with it

    admin_app, admin_host, admin_port = admin
    admin_server = AdminServer(
        uvicorn.Config(
            admin_app,  # type: ignore[arg-type]
            host=admin_host,
            port=admin_port,
            lifespan="off",
            interface="asgi3",  # a bound method is not auto-detected as ASGI 3
            log_level=log_level,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=2,
            **uvicorn_options(limits or ServingLimits(), forwarded_allow_ips, admin=True),
        )
    )

    async def serve_admin() -> None:
        # uvicorn exits (SystemExit) when it cannot bind; here that ends this task, not the process.
        with contextlib.suppress(SystemExit):
            await admin_server.serve()

    async def both() -> int:
        admin_task = asyncio.create_task(serve_admin())
        while not admin_server.started:
            if admin_task.done():
                # uvicorn has logged why (the address is in use, or not this machine's: StartupWords).
                return _not_started(
                    f"cannot listen on --admin-listen {admin_host}:{admin_port}", EXIT_NOT_STARTED
                )
            await asyncio.sleep(0.01)
        try:
            await server.serve()
        finally:
            admin_server.should_exit = True
            await admin_task
        return 0 if server.started else EXIT_NOT_STARTED

    # The loop uvicorn would pick for itself (uvloop when installed, as `uvicorn[standard]` installs
    # it): `server.run()` chooses it, a bare `asyncio.run` would not, and the stdlib loop costs the
    # data path about twice the CPU per request (issue #12's profile).
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        return runner.run(both())


def _freeze_startup_objects() -> None:
    """What start-up built (the modules, the policy, the app, its pollers and clients: ~80,000 objects
    after the imports alone) lives as long as the process: moved out of the cycle collector's sight
    (``gc.freeze``). Otherwise every full collection walks all of it on the event loop's thread: a
    40-80 ms stall under load (the overhead benchmark's paced phase: ``bench/probed_sidecar.py``
    records the collector's pauses). Refcounting still frees them; only a cycle among them is kept."""
    import gc

    gc.collect()
    gc.freeze()


# How long a thread holding the GIL keeps it while another thread waits (CPython's default: 5 ms).
LOOP_SWITCH_INTERVAL_S = 0.001


def _prefer_the_loop() -> None:
    """The pollers' blocking work runs on threads (``signals/worker.py``): parsing a ``/metrics``
    exposition of 8x the usual series takes tens of ms of Python there, and the event loop's thread,
    asking for the GIL back, waited a whole switch interval (5 ms) each time: 6-9 ms loop stalls with
    nothing but polling going on (``bench/overhead.py --metrics-repeat 8``, on 2 cores and on the
    H200 host). At 1 ms the loop gets the GIL back within a millisecond; the threads only lose time
    when the loop wants the interpreter, which is what the loop is for."""
    sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)


def _wait(args: argparse.Namespace) -> int:
    """Poll ``url`` until it answers 200; print what it last said otherwise. Exit 0 ready, 1 not."""
    import time

    import httpx

    deadline = time.monotonic() + args.timeout
    last = "no answer yet"
    with httpx.Client(timeout=5.0) as client:
        while True:
            try:
                r = client.get(args.url)
                if r.status_code == 200:
                    print(f"{args.url}: ready")
                    return 0
                try:
                    problems = r.json().get("problems")
                except ValueError:
                    problems = None
                last = f"{r.status_code}" + (f": {'; '.join(problems)}" if problems else "")
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if time.monotonic() >= deadline:
                print(f"{args.url}: not ready after {args.timeout:g} s ({last})", file=sys.stderr)
                return 1
            time.sleep(0.25)


def _status(args: argparse.Namespace) -> int:
    """Two readings ``--interval`` apart, then the view; with ``--watch`` a new view every interval."""
    import time

    import httpx

    from sidecar.ops.status import Unreachable, read_sample, render_text, view

    if args.interval <= 0:
        return _fail("--interval must be above 0")
    shown = 0
    try:
        with httpx.Client(timeout=5.0) as client:
            prev = read_sample(client, args.admin, time.monotonic)
            while True:
                time.sleep(args.interval)
                cur = read_sample(client, args.admin, time.monotonic)
                text = render_text(view(cur, prev))
                if args.watch and sys.stdout.isatty():
                    text = "\x1b[H\x1b[2J" + text  # home, clear: redraw in place
                print(
                    text + (f"({args.admin}, {time.strftime('%H:%M:%S')})\n" if args.watch else ""),
                    flush=True,
                )
                shown += 1
                prev = cur
                if not args.watch or (args.count is not None and shown >= args.count):
                    return 0
    except Unreachable as e:
        print(f"sglang-sidecar status: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _demo(args: argparse.Namespace) -> int:
    from sidecar_emulator.demo import run_demo

    return run_demo(args)


def _emulate(args: argparse.Namespace) -> int:
    from sidecar.ops.logs import installed
    from sidecar_emulator.server import main as emulate_main

    with installed("info", "text"):
        return emulate_main(args)


def _init(args: argparse.Namespace) -> int:
    from sidecar.calibrate.starter import main as init_main

    return init_main(args)


def _calibrate(args: argparse.Namespace) -> int:
    from sidecar.calibrate.command import main as calibrate_main

    return calibrate_main(args)


def _replay(args: argparse.Namespace) -> int:
    if args.lanes:
        from sidecar_emulator.fleet_replay import main as fleet_main

        return fleet_main(args)
    from sidecar_emulator.replay import main as replay_main

    return replay_main(args)


if __name__ == "__main__":
    sys.exit(main())
