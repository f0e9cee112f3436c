"""`serve` settings: each option is a flag and an environment variable (``SIDECAR_*``).

Precedence: command-line flag > environment > default. The policy file holds what the lane needs;
these hold where things are and how the process runs.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Mode(StrEnum):
    ENFORCE = "enforce"
    SHADOW = "shadow"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIDECAR_", extra="forbid", frozen=True)

    upstream: str = Field(description="Base URL of the SGLang server, e.g. http://127.0.0.1:30000")
    listen: str = Field(default="127.0.0.1:8001", description="HOST:PORT to listen on")
    policy: Path = Field(description="Lane policy YAML (see policies/)")
    gpu_source: str | None = Field(
        default=None,
        description="nvml | nvml:<uuid>[,<uuid>] | dcgm:<url> | file:<path>; required unless the policy "
        "sets gpu.required: false",
    )
    mode: Mode = Mode.ENFORCE
    admin_token_file: Path | None = Field(default=None, description="Bearer token for POST /admission/policy")
    decision_log: Path | None = Field(
        default=None, description="Append decision JSON lines here (default: stderr)"
    )
    # Connection pool to the engine, sized for long SSE streams: each open stream holds one connection.
    max_connections: int = Field(default=1024, ge=1)
    # A 500K-token prefill can take minutes before its first byte; this bounds the gap between bytes.
    upstream_read_timeout_s: float = Field(default=1800.0, gt=0)
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    # SIGTERM: stop admitting, let in-flight streams finish for up to this long.
    drain_timeout_s: float = Field(default=30.0, ge=0)
    log_level: str = "info"
    # Load generation against the emulator only: honour a client's `emulator.prompt_tokens` size
    # declaration. Off in front of a real engine, where it would let any client bypass the gate.
    trust_emulator_sizes: bool = False

    @field_validator("upstream")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http:// or https:// URL, got {v!r}")
        return v.rstrip("/")

    @field_validator("listen")
    @classmethod
    def _hostport(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"listen must be HOST:PORT, got {v!r}")
        return v

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    def admin_token(self) -> str | None:
        if self.admin_token_file is None:
            return None
        token = self.admin_token_file.read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"{self.admin_token_file}: the admin token file is empty")
        return token
