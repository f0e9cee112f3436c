"""`serve` settings: each option is a flag and an environment variable (``SIDECAR_*``).

Precedence: command-line flag > environment > default. The policy file holds what the lane needs;
these hold where things are and how the process runs.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sidecar.http.hosts import HostCheck
from sidecar.http.server import ServingLimits

# serve's exit statuses (`serve --help` lists them; docs/operate.md too).
EXIT_USAGE = 2  # invalid flags, environment, policy, GPU source spec or token file: nothing started
EXIT_NOT_STARTED = 3  # valid, but could not start: the GPU source unreadable, a port taken


class Mode(StrEnum):
    ENFORCE = "enforce"
    SHADOW = "shadow"


def _opt(default: object = ..., *, help: str, metavar: str | None = None, **kw: object) -> Any:
    """A setting with what ``serve --help`` prints for it (the flag and its env var come from the name)."""
    return Field(default, description=help, json_schema_extra={"metavar": metavar} if metavar else None, **kw)


class Settings(BaseSettings):
    """Every field is a ``serve`` flag (``--upstream-read-timeout-s``) and an environment variable
    (``SIDECAR_UPSTREAM_READ_TIMEOUT_S``); ``cli`` builds the parser from these fields, so a new
    setting cannot be missing from ``--help`` or lack its variable."""

    model_config = SettingsConfigDict(env_prefix="SIDECAR_", extra="forbid", frozen=True)

    upstream: str = _opt(help="base URL of the SGLang server, e.g. http://127.0.0.1:30000", metavar="URL")
    listen: str = _opt(
        "127.0.0.1:8001",
        help="the data port: the engine's paths (gated and proxied), /healthz and /readyz",
        metavar="HOST:PORT",
    )
    # The admin port: state, explain, policy upload, routing signals, docs and /metrics. Loopback by
    # default: what it says (policy path, engine address, live load) is for operators, not clients.
    admin_listen: str = _opt(
        "127.0.0.1:8002",
        help="the admin port: /admission/* (state, explain, policy, signals, loads, docs) and /metrics",
        metavar="HOST:PORT",
    )
    admin_on_data_port: bool = _opt(
        False,
        help="also serve the admin paths on the data port, the old layout (deprecated: for scrapers and "
        "scripts not moved to --admin-listen yet; the data port's state then hides paths and addresses)",
    )
    allowed_hosts: str | None = _opt(
        None,
        help="comma-separated Host names both ports answer (421 otherwise); IP literals and localhost are "
        "always answered. Without it the data port answers any Host and the admin port only IPs and "
        "localhost",
        metavar="NAMES",
    )
    policy: Path = _opt(help="lane policy YAML (see policies/)", metavar="FILE")
    policy_watch_s: float = _opt(
        2.0,
        ge=0,
        help="look at the policy file this often and apply it when it changed (a ConfigMap update, an "
        "edit; refused and logged when invalid); 0: only on SIGHUP",
        metavar="S",
    )
    gpu_source: str | None = _opt(
        None,
        help="where free GPU memory is read: nvml | nvml:<uuid>[,<uuid>] | dcgm:<url> | file:<path>; "
        "required unless the policy sets gpu.required: false",
        metavar="SPEC",
    )
    mode: Mode = _opt(Mode.ENFORCE, help="shadow: decide and record, always forward")
    admin_token_file: Path | None = _opt(
        None, help="bearer token for POST /admission/policy (uploads disabled without it)", metavar="FILE"
    )
    decision_log: Path | None = _opt(
        None,
        help="append decision lines here, always JSON (default: the log stream, in --log-format)",
        metavar="FILE",
    )
    decision_log_max_bytes: int = _opt(
        0,
        help="roll --decision-log over when it would pass this many bytes (FILE.1 the newest); 0: never, "
        "leave rotation to logrotate, which renames the file and sends SIGUSR1 to reopen it",
        metavar="BYTES",
        ge=0,
    )
    decision_log_backups: int = _opt(
        5, help="rolled-over decision-log files kept with --decision-log-max-bytes", metavar="N", ge=1
    )
    forwarded_allow_ips: str | None = _opt(
        None,
        help="proxies (addresses or networks, comma-separated, or *) whose X-Forwarded-For and "
        "X-Forwarded-Proto set the client address the access log shows; default: none is trusted",
        metavar="IPS",
    )
    # Connection pool to the engine, sized for long SSE streams: each open stream holds one connection.
    max_connections: int = _opt(1024, ge=1, help="upstream connection pool size", metavar="N")
    # A 500K-token prefill can take minutes before its first byte; this bounds the gap between bytes.
    upstream_read_timeout_s: float = _opt(
        1800.0, gt=0, help="longest gap between upstream bytes before 504 (or a cut stream)", metavar="S"
    )
    upstream_connect_timeout_s: float = _opt(
        5.0, gt=0, help="time to connect to the upstream before 503 engine_unavailable", metavar="S"
    )
    # sidecar/http/engine_client.py: the same relay for less CPU than aiohttp's client (on 2 cores 40-45 % less per
    # pass-through request, about a fifth less per SSE event: bench/results/floor-variants.md). aiohttp
    # stays selectable, and carries https:// engines (the lean client speaks plain HTTP/1.1 only).
    upstream_client: Literal["lean", "aiohttp"] = _opt(
        "lean",
        help="the HTTP client to the engine: lean (asyncio + httptools, sidecar/http/engine_client.py: less CPU per "
        "request) or aiohttp (the earlier client; an https:// engine is always reached through it)",
    )
    # SIGTERM: stop admitting, let in-flight streams finish for up to this long.
    drain_timeout_s: float = _opt(
        30.0,
        ge=0,
        help="on SIGTERM, time in-flight requests get to finish before the listener closes",
        metavar="S",
    )
    state_file: Path | None = _opt(
        None,
        help="keep what the lane taught (the margin a crash or the monitor set, the engine build, an "
        "unconfirmed build and since when) in this JSON file across sidecar restarts; written atomically "
        "as it changes; a file it cannot use stops the start (docs/robustness.md)",
        metavar="FILE",
    )
    log_level: Literal["debug", "info", "warning", "error"] = _opt(
        "info", help="the sidecar's own log level (HTTP libraries stay at warning)"
    )
    log_queue_lines: int = _opt(
        10_000,
        ge=1,
        help="log lines buffered while stderr is slow; beyond that they are dropped and counted "
        "(log_lines_dropped_total), never waited for",
        metavar="N",
    )
    log_format: Literal["text", "json"] = _opt(
        "text", help="one format for every line: uvicorn's, the sidecar's, the access and decision logs"
    )
    # Load generation against the emulator only: honour a client's `emulator.prompt_tokens` size
    # declaration. Off in front of a real engine, where it would let any client bypass the gate.
    trust_emulator_sizes: bool = _opt(
        False,
        help="honour a client's emulator.prompt_tokens size declaration: only for load generation "
        "against the emulator, never in front of a real engine",
    )

    # The data port's per-connection limits (sidecar/http/server.py says why each exists).
    header_timeout_s: float = _opt(
        10.0,
        gt=0,
        help="time a client gets to send its request line and headers (408, or closed if it sent nothing)",
        metavar="S",
    )
    body_timeout_s: float = _opt(
        30.0, gt=0, help="longest gap between a request body's bytes (408 if no response yet)", metavar="S"
    )
    max_header_bytes: int = _opt(
        64 * 1024, ge=1024, help="request line and headers larger than this get 431", metavar="BYTES"
    )
    max_client_connections: int = _opt(
        2048,
        ge=1,
        help="open client connections: one beyond it is closed at once, a request beyond it gets 503; "
        "lowered at start to fit the descriptor limit (2 per connection + 128 kept free)",
        metavar="N",
    )

    def serving_limits(self) -> ServingLimits:
        return ServingLimits(
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            max_header_bytes=self.max_header_bytes,
            max_client_connections=self.max_client_connections,
        )

    @field_validator("upstream")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http:// or https:// URL, got {v!r}")
        return v.rstrip("/")

    @field_validator("listen", "admin_listen")
    @classmethod
    def _hostport(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"must be HOST:PORT, got {v!r}")
        return v

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, v: str | None) -> str | None:
        if v is not None:
            HostCheck.parse(v)  # raises ValueError with the offending entry
        return v

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @property
    def admin_host(self) -> str:
        return self.admin_listen.rpartition(":")[0].strip("[]")

    @property
    def admin_port(self) -> int:
        return int(self.admin_listen.rpartition(":")[2])

    def host_check(self) -> HostCheck | None:
        """The data port's check: none unless ``--allowed-hosts`` is given."""
        return None if self.allowed_hosts is None else HostCheck.parse(self.allowed_hosts)

    def admin_host_check(self) -> HostCheck:
        """The admin port always checks: IP literals, localhost and ``--allowed-hosts``."""
        return HostCheck.parse(self.allowed_hosts or "")

    def admin_token(self) -> str | None:
        if self.admin_token_file is None:
            return None
        token = self.admin_token_file.read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"{self.admin_token_file}: the admin token file is empty")
        return token
