"""The state file (``serve --state-file``, ``SIDECAR_STATE_FILE``): what the lane taught the sidecar,
kept across a sidecar restart (docs/robustness.md).

It holds the lane watch's ``kept()`` value as JSON: the margins learned against the policy's costs
(the monitor's and a crash's), the engine build, and whether that build is confirmed. Written whenever
one of them changes, atomically (a temporary file in the same directory, flushed and synced, then
renamed over the old one), so a crash mid-write leaves the previous file whole. Read once at start:
a missing file is a first start, an unreadable one is logged and ignored (the policy alone, the safe
side of nothing learned is the policy's own margin, which a crash has not yet raised).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from sidecar.admission.lane_watch import LaneWatch

log = logging.getLogger("sidecar.ops.learned_file")


def restore(path: Path, watch: LaneWatch) -> str | None:
    """Load what a previous run learned into ``watch``; what was taken (None: no file yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("state file %s unreadable, starting from the policy alone: %s", path, e)
        return None
    try:
        saved = json.loads(text)
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        log.warning("state file %s is not a state (%s), starting from the policy alone", path, e)
        return None
    said = watch.restore(saved)
    log.info(
        "state file %s: %s", path, said, extra={"fields": {"event": "state_restored", "path": str(path)}}
    )
    return said


def write(path: Path, state: dict[str, Any]) -> None:
    """Replace ``path`` with ``state`` atomically; a failure is logged (the gate goes on)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        log.warning("state file %s not written (what was learned stays in memory): %s", path, e)


def keep(path: Path, watch: LaneWatch) -> None:
    """Restore from ``path``, then write it whenever the watch learns something it keeps."""
    restore(path, watch)
    watch.on_learned = lambda: write(path, watch.kept())
