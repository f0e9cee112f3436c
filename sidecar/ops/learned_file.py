"""The state file (``serve --state-file``, ``SIDECAR_STATE_FILE``): what the lane taught the sidecar,
kept across a sidecar restart (docs/robustness.md "The state file").

It holds the lane watch's ``kept()`` value as JSON: the margins learned against the policy's costs
(the monitor's and a crash's), the engine build, and, while that build is unconfirmed, why, since when
(wall-clock Unix seconds here; the watch keeps its own monotonic clock, converted at this edge) and the
margin in force; and the crash evidence not read yet (the set admitted when the engine was seen
failing, a restart whose new process has not reported), its instants converted the same way. Written
whenever one of them changes, atomically (a temporary file in the same directory, flushed and synced,
then renamed over the old one), so a crash mid-write leaves the previous file whole. Read once at
start: a missing file is a first start. A file that cannot be read, is not JSON, or is not a state this
sidecar wrote (a field missing, of the wrong type, or unknown; another layout version) stops the start
with the file and the field named (``StateFileError``): starting from the policy alone would forget a
crash's margin, an unconfirmed build or a crash not read yet, and price the lane on what the file was
kept to correct. Deleting the file is the operator's explicit way to start afresh.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sidecar.admission.lane_watch import MAX_IDS, STATE_VERSION, LaneWatch
from sidecar.policy.yamlfile import ConfigError

log = logging.getLogger("sidecar.ops.learned_file")

# Tell the operator how out of a refused file (the problems name what is wrong with it).
_START_AFRESH = "delete the file to start from the policy alone (what it kept is then lost)"


class StateFileError(ConfigError):
    """A state file that cannot be restored, each problem as ``file[:line]: field: problem``."""

    kind = "state file"


_STRICT = ConfigDict(extra="forbid", strict=True)
# Unix seconds (the watch's instants as this edge writes them).
Instant = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class SavedSet(BaseModel):
    """An admitted set kept as crash evidence (``AdmittedSet.kept``): what ``crash_margin`` reads."""

    model_config = _STRICT

    at: Instant  # when the engine was seen failing with it admitted
    request_ids: list[str] = Field(max_length=MAX_IDS)
    requests: int = Field(ge=0)
    projected_bytes: int = Field(ge=0)
    priced_margin: float = Field(gt=0, allow_inf_nan=False)
    budget_bytes: int | None
    reserve_bytes: int = Field(ge=0)
    engine_pids: list[str] = Field(max_length=4096)

    def problems(self, where: str) -> list[tuple[str, str]]:
        if self.requests < len(self.request_ids):
            return [
                (f"{where}.requests", f"{self.requests} is below the {len(self.request_ids)} request_ids")
            ]
        return []


class SavedRestart(BaseModel):
    """An engine restart noticed with work admitted, not read yet (the new process never reported)."""

    model_config = _STRICT

    at: Instant  # when the restart was noticed
    why: str = Field(min_length=1)
    admitted: SavedSet


class SavedState(BaseModel):
    """The layout ``LaneWatch.kept`` writes (``STATE_VERSION``). Strict: JSON's own types, no field
    this sidecar does not write (a file of another kind, pointed at by mistake, fails here)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    version: int  # = STATE_VERSION (``load`` refuses another before the fields are read)
    cost_fingerprint: str = Field(pattern=r"^[0-9a-f]{16}$")
    margin: float = Field(gt=0, allow_inf_nan=False)
    crash_margin: float | None = Field(gt=0, allow_inf_nan=False)
    crashes: int = Field(ge=0)
    engine_build: str | None = Field(min_length=1)
    conservative: str | None = Field(min_length=1)
    # Added with the unconfirmed build's time; absent in files written before (read as "now").
    conservative_since: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    margin_in_force: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Added with the crash evidence not read yet; absent in files written before (none pending).
    at_risk: SavedSet | None = None
    pending_restart: SavedRestart | None = None

    def problems(self) -> list[tuple[str, str]]:
        """(field, problem) for what each field allows alone but not with the others."""
        out: list[tuple[str, str]] = []
        if self.conservative is not None and self.engine_build is None:
            out.append(("conservative", "an unconfirmed build with no engine_build"))
        if self.conservative is None and self.conservative_since is not None:
            out.append(("conservative_since", "set while conservative is null"))
        if self.crash_margin is not None and self.crash_margin > self.margin:
            # ``kept()`` writes the margin at or above what a crash taught; a hand edit that lowers the
            # margin under it would serve below the crash's margin until the next reload.
            out.append(("crash_margin", f"{self.crash_margin} is above margin {self.margin}"))
        if self.margin_in_force is not None and self.margin_in_force < self.margin:
            out.append(("margin_in_force", f"{self.margin_in_force} is below margin {self.margin}"))
        if self.at_risk is not None:
            out += self.at_risk.problems("at_risk")
        if self.pending_restart is not None:
            out += self.pending_restart.admitted.problems("pending_restart.admitted")
        return out


def load(path: Path) -> SavedState | None:
    """The state in ``path``, validated; None where there is no file yet."""
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        problem = f"{where}: cannot read: {getattr(e, 'strerror', None) or e}"
        raise StateFileError(where, [problem, _START_AFRESH]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise StateFileError(where, [f"{where}:{e.lineno}: not JSON: {e.msg}", _START_AFRESH]) from None
    if not isinstance(data, dict):
        problem = f"{where}: (top level): expected a JSON object, got {type(data).__name__}"
        raise StateFileError(where, [problem, _START_AFRESH])
    version = data.get("version")
    if version != STATE_VERSION:
        problem = (
            f"{where}: version: {version!r}: not a state file of this sidecar (it writes version "
            f"{STATE_VERSION}; a file of another kind, or of another sidecar release)"
        )
        raise StateFileError(where, [problem, _START_AFRESH])
    try:
        saved = SavedState.model_validate(data)
    except ValidationError as e:
        problems = [f"{where}: {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise StateFileError(where, [*problems, _START_AFRESH]) from None
    if bad := saved.problems():
        raise StateFileError(where, [*(f"{where}: {f}: {p}" for f, p in bad), _START_AFRESH])
    return saved


def restore(
    path: Path,
    watch: LaneWatch,
    now: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> str | None:
    """Load what a previous run learned into ``watch`` (``now``: the watch's clock; ``wall``: Unix
    seconds); what was taken (None: no file yet). Raises ``StateFileError`` for a file it cannot use."""
    saved = load(path)
    if saved is None:
        return None
    kept: dict[str, Any] = saved.model_dump()
    # Unix seconds to the watch's clock; a time ahead of this host's clock (another host's skew) counts
    # from now.
    kept = _instants(kept, lambda at: now() - max(0.0, wall() - at))
    said = watch.restore(kept, now())
    log.info(
        "state file %s: %s", path, said, extra={"fields": {"event": "state_restored", "path": str(path)}}
    )
    return said


def to_file(kept: dict[str, Any], now: float, wall: float) -> dict[str, Any]:
    """``LaneWatch.kept`` with its clock's times as Unix seconds (``now``, ``wall``: the same instant)."""
    return _instants(kept, lambda at: round(wall - (now - at), 3))


def _instants(kept: dict[str, Any], convert: Callable[[float], float]) -> dict[str, Any]:
    """``kept`` with each instant in it (those not null) converted: from the watch's clock to Unix
    seconds or back."""
    out = dict(kept)
    if out.get("conservative_since") is not None:
        out["conservative_since"] = convert(out["conservative_since"])
    if (risk := out.get("at_risk")) is not None:
        out["at_risk"] = risk | {"at": convert(risk["at"])}
    if (pending := out.get("pending_restart")) is not None:
        admitted = pending["admitted"] | {"at": convert(pending["admitted"]["at"])}
        out["pending_restart"] = pending | {"at": convert(pending["at"]), "admitted": admitted}
    return out


def write(path: Path, state: dict[str, Any]) -> None:
    """Replace ``path`` with ``state`` atomically; a failure is logged (the gate goes on)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, sort_keys=True, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        log.warning("state file %s not written (what was learned stays in memory): %s", path, e)


def keep(
    path: Path,
    watch: LaneWatch,
    now: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> None:
    """Restore from ``path`` (``StateFileError`` stops the start), then write it whenever the watch
    learns something it keeps."""
    restore(path, watch, now, wall)
    watch.on_learned = lambda: write(path, to_file(watch.kept(), now(), wall()))
