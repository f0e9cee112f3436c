"""Logging for a process that must never wait on its own log: one format, one bounded queue, one writer.

Every log record - the sidecar's, uvicorn's, the access log, the decision log when it goes to stderr -
is put on a bounded queue by a non-blocking :class:`DroppingQueueHandler` and written by one
:class:`logging.handlers.QueueListener` thread. If stderr is a pipe nobody reads (a stalled log
collector), that thread blocks, the queue fills, and further records are dropped and counted
(``log_lines_dropped_total``): the event loop, and so ``/healthz`` and the data path, never wait.

One format at a time (``--log-format``):

* ``text``: ``2026-12-01T16:44:17.123Z INFO sidecar.http.access_log: POST /generate 200 decision=admit ...``;
* ``json``: one object per line, ``{"ts": 1764607457.123, "time": "...", "level": "info", "logger":
  "sidecar.http.access_log", "message": "POST /generate 200", "decision": "admit", ...}``. Decision-log lines
  keep their fields at the top level, so ``replay`` reads a JSON log like a ``--decision-log`` file.

Structured fields travel in ``extra={"fields": {...}}``; both formats show all of them.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import logging.handlers
import os
import queue
import re
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
# Libraries that log per request or per connection at DEBUG/INFO: at --log-level debug an operator
# wants the sidecar's own reasoning, not thousands of lines of HTTP plumbing.
NOISY = ("httpx", "httpcore", "hpack", "aiohttp", "asyncio", "multipart", "urllib3", "matplotlib", "PIL")
DEFAULT_QUEUE = 10_000


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...``; values with spaces are quoted."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_iso(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + record.exc_text
        return line


def _text_value(v: Any) -> str:
    if isinstance(v, dict | list):
        return json.dumps(v, separators=(",", ":"))
    s = "-" if v is None else str(v)
    return json.dumps(s) if (" " in s or not s) else s


class JsonFormatter(logging.Formatter):
    """One JSON object per record; structured fields at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "time": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, separators=(",", ":"), default=str)


def formatter(fmt: str) -> logging.Formatter:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


class StreamWriter(logging.Handler):
    """The one handler that writes, on the listener's thread only.

    Writes straight to the file descriptor (no buffer left for exit to flush) and takes no lock while
    writing: with the pipe full the write blocks this thread alone, and ``logging.shutdown`` at exit -
    which takes every handler's lock - still gets through, so a stalled collector cannot keep the
    process from exiting.
    """

    def __init__(self, stream: IO[str]) -> None:
        super().__init__()
        self.stream = stream
        try:
            self.fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):
            self.fd = None  # an in-memory stream (tests)

    def handle(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            if self.fd is None:
                self.stream.write(line)
                self.stream.flush()
                return
            data = memoryview(line.encode("utf-8", "replace"))
            while data:
                data = data[os.write(self.fd, data) :]
        except Exception:
            pass  # nowhere left to report a failure to write the log

    def flush(self) -> None:
        pass


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """A QueueHandler that never blocks and never prints a traceback when the queue is full: it drops
    the record and counts it. (The stock one would call ``handleError``, which writes to stderr -
    the very stream that is stalled.)"""

    def __init__(self, q: queue.Queue[Any]) -> None:
        super().__init__(q)
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """Merge the args into the message now (the caller's objects may change later) and keep a
        traceback as text; the formatting proper (JSON, key=value) happens on the writer thread."""
        r = copy.copy(record)
        r.msg = record.getMessage()
        r.args = None
        if record.exc_info:
            r.exc_text = record.exc_text or _TRACEBACKS.formatException(record.exc_info)
        r.exc_info = None
        return r


_TRACEBACKS = logging.Formatter()


class LogPipeline:
    """The process's logging: installed once by :func:`setup_logging`, stopped at exit."""

    def __init__(self, handler: DroppingQueueHandler, listener: logging.handlers.QueueListener) -> None:
        self.handler = handler
        self.listener = listener

    @property
    def dropped(self) -> int:
        return self.handler.dropped

    def stop(self, timeout_s: float = 2.0) -> None:
        """Write what is queued, then stop the writer thread; never hangs on a stalled stream."""
        root = logging.getLogger()
        if self.handler in root.handlers:
            root.removeHandler(self.handler)
        thread = getattr(self.listener, "_thread", None)
        try:
            self.listener.queue.put_nowait(self.listener._sentinel)  # type: ignore[attr-defined]
        except queue.Full:
            return  # the writer is stuck on the stream; its thread is a daemon
        if thread is not None:
            thread.join(timeout_s)
        self.listener._thread = None  # type: ignore[attr-defined]


_current: LogPipeline | None = None


_BIND = re.compile(r"error while attempting to bind on address \('?([^',]+)'?, (\d+)\)(?:: (.*))?")
# What uvicorn says after the application said why; the why is already in the log.
_REDUNDANT = ("Application startup failed. Exiting.",)


class StartupWords(logging.Filter):
    """uvicorn's start-up failures in the sidecar's words, under its own logger (``sidecar``,
    ``event=startup_failed``), in the chosen format: a port already taken names the port and how to
    find who holds it; the line that repeats an application's failure is dropped (the sidecar logged
    the reason itself). Everything else uvicorn says passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        message = record.getMessage()
        if message in _REDUNDANT:
            return False
        m = _BIND.search(message)
        if m is None:
            return True
        host, port, why = m.group(1), m.group(2), (m.group(3) or "").strip() or "cannot bind"
        record.name = "sidecar"
        record.msg = (
            f"cannot listen on {host}:{port}: {why} (who holds it: ss -ltnp 'sport = :{port}'; "
            "or choose another with --listen / --admin-listen)"
        )
        record.args = ()
        record.fields = {"event": "startup_failed", "address": f"{host}:{port}", "exit_code": 3}  # type: ignore[attr-defined]
        return True


def setup_logging(
    level: str = "info",
    fmt: str = "text",
    stream: IO[str] | None = None,
    max_queue: int = DEFAULT_QUEUE,
) -> LogPipeline:
    """Route every logger through one bounded queue to ``stream`` (stderr) in one format.

    ``level`` applies to the sidecar's own loggers (``sidecar.*``); uvicorn's stay at INFO and the
    HTTP libraries at WARNING unless they have something worse to say.
    """
    global _current
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    if _current is not None:
        _current.stop()
    out = StreamWriter(stream or sys.stderr)
    out.setFormatter(formatter(fmt))
    q: queue.Queue[Any] = queue.Queue(max_queue)
    handler = DroppingQueueHandler(q)
    listener = logging.handlers.QueueListener(q, out, respect_handler_level=False)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    numeric = getattr(logging, level.upper())
    # Third-party loggers inherit the root's level; the sidecar's own get the one asked for.
    root.setLevel(max(numeric, logging.INFO))
    logging.getLogger("sidecar").setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.asgi"):
        logging.getLogger(name).setLevel(max(numeric, logging.INFO))
    for name in NOISY:
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
    # uvicorn's loggers must not carry handlers of their own (they would write to stderr directly).
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.propagate = True
    error_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, StartupWords) for f in error_log.filters):
        error_log.addFilter(StartupWords())
    listener.start()
    _current = LogPipeline(handler, listener)
    return _current


def current() -> LogPipeline | None:
    """The installed pipeline (for the drop counter), or None when logging was not set up by us."""
    return _current


@contextlib.contextmanager
def installed(level: str = "info", fmt: str = "text", stream: IO[str] | None = None) -> Iterator[LogPipeline]:
    """setup_logging for a block (tests, the demo); restores nothing but stops the writer thread."""
    global _current
    pipeline = setup_logging(level, fmt, stream)
    try:
        yield pipeline
    finally:
        pipeline.stop()
        _current = None
