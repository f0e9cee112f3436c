"""The ``--decision-log`` file: reopened on SIGUSR1, and rotated by size when asked.

A busy lane writes ~1 KB per decision. Two ways keep its disk from filling, both through the
standard library's :class:`logging.handlers.RotatingFileHandler` (which opens, renames and numbers
the files; nothing here re-implements it):

* logrotate (``deploy/logrotate/sglang-sidecar``) renames the file, then sends SIGUSR1: the writer
  closes the renamed file and opens a new one at the configured path before its next batch. SIGHUP
  stays the policy reload: a log rotation must not reload a policy someone is editing.
* ``--decision-log-max-bytes N``: the sidecar rolls the file over itself when the next batch would
  take it past N bytes, keeping ``--decision-log-backups`` old files (``FILE.1`` the newest).

Only the decision-log writer's thread (``telemetry.LineWriter``) writes, rolls over or reopens; a
signal only raises a flag, so no line is split across two files or lost between them.
"""

from __future__ import annotations

import logging.handlers
from pathlib import Path


class DecisionFile:
    """A text stream for ``LineWriter``: ``write`` whole batches of lines, ``request_reopen`` anywhere."""

    def __init__(self, path: str | Path, max_bytes: int = 0, backups: int = 5) -> None:
        # delay=False: a path that cannot be opened fails at start-up, not at the first decision.
        self._handler = logging.handlers.RotatingFileHandler(
            path, mode="a", maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
        )
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._reopen = False
        self.reopened = 0
        self.rolled_over = 0

    def request_reopen(self) -> None:
        """SIGUSR1 (any thread, a signal handler included): the next write goes to a freshly opened
        file at ``path``. A flag only: the writer thread does the reopening between two batches."""
        self._reopen = True

    def write(self, text: str) -> int:
        h = self._handler
        if self._reopen:
            self._reopen = False
            h.close()
            h.stream = h._open()
            self.reopened += 1
        stream = h.stream
        if self.max_bytes and stream.tell() and stream.tell() + len(text.encode("utf-8")) > self.max_bytes:
            h.doRollover()  # the stdlib's rename chain: FILE -> FILE.1 -> ... -> FILE.<backups>
            self.rolled_over += 1
            stream = h.stream
        return stream.write(text)

    def flush(self) -> None:
        if self._handler.stream is not None:
            self._handler.stream.flush()

    def close(self) -> None:
        self._handler.close()
