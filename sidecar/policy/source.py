"""One source of truth for the running policy: the policy file.

Three paths change the policy: the file changing (watched: ``reload_if_changed``, polled by the app),
SIGHUP (re-read the file) and ``POST /admission/policy`` (an upload). If an
upload only changed memory, the next SIGHUP - sent by a config-management run that knows nothing of the
upload - would silently put the file's policy back. So the rule is:

* an upload is validated, then written to the policy file atomically (a temporary file in the same
  directory, then ``os.replace``), then applied; the file and the running policy never disagree;
* when the file or its directory is not writable (a Kubernetes ConfigMap, a read-only mount), the upload
  is refused with 409 and nothing changes: change the file where it comes from and send SIGHUP;
* without a policy file (the sidecar embedded in a test or a benchmark) an upload is applied in memory.

Every attempt, from either path, is logged with its result and recorded: ``last_reload`` and
``last_failure`` are served in ``/admission/state`` and counted by ``policy_reloads_total{result}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from sidecar.policy.schema import LoadedPolicy, PolicyError, load_policy_file, load_policy_text

log = logging.getLogger("sidecar.policy.schema")


@dataclass(frozen=True, slots=True)
class ReloadRecord:
    """One reload attempt: when (wall clock, for people), how, and what came of it."""

    at: float
    via: str  # "sighup" | "file_change" | "upload"
    result: str  # "applied" | "refused"
    policy: str | None
    sha256: str | None
    error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class UploadRefused(Exception):
    """An upload that changed nothing, with the HTTP status that says why (422 invalid, 409 file)."""

    def __init__(self, status: int, code: str, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.problems = status, code, message, problems


class PolicySource:
    """Reads, writes and applies the policy; ``apply`` swaps it in (raises PolicyError to refuse)."""

    def __init__(
        self,
        path: str | None,
        apply: Callable[[LoadedPolicy], None],
        current: Callable[[], LoadedPolicy],
        on_attempt: Callable[[bool], None] = lambda applied: None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._apply = apply
        self._current = current
        self._on_attempt = on_attempt
        self._wall = wall
        self.last_reload: ReloadRecord | None = None
        self.last_failure: ReloadRecord | None = None
        self._previous: LoadedPolicy | None = None
        self._seen: FileIdentity | None = None

    # -- SIGHUP ----------------------------------------------------------------------------------

    def reload_file(self, via: str = "sighup") -> ReloadRecord:
        """Re-read the policy file and apply it; a file that fails validation changes nothing."""
        if self.path is None:
            return self._record(via, None, "no policy file to reload (started without --policy)")
        try:
            loaded = load_policy_file(self.path)
            self._apply(loaded)
        except PolicyError as e:
            return self._record(via, None, str(e))
        except Exception as e:
            # Whatever else refuses it (a bug of ours included) is still a refusal: counted, recorded
            # and alerted on (SidecarPolicyReloadFailing), not a traceback the alert never sees.
            log.exception("policy reload via %s: unexpected error", via)
            return self._record(via, None, _unexpected(self.path, e))
        return self._record(via, loaded, None)

    # -- the file watch ----------------------------------------------------------------------------

    def reload_if_changed(self) -> ReloadRecord | None:
        """Re-read the file when it changed and says something other than the policy in force.

        Cheap enough to call every second or two: one ``stat`` while nothing changes. A change is any
        of a Kubernetes ConfigMap update (the kubelet swaps the mount's ``..data`` symlink: the file's
        real path moves), a new file renamed into place (the inode) or an edit in place (mtime, size).
        The content decides: a change that leaves the policy in force as it is (an upload writing the
        file, ``touch``) reloads nothing; a file that fails validation is refused once, and tried again
        only when it changes again. A file that vanished (mid-swap) is looked at when it is back.
        """
        if self.path is None:
            return None
        seen = file_identity(self.path)
        if seen == self._seen:
            return None
        self._seen = seen
        if seen is None:
            return None
        try:
            data = Path(self.path).read_bytes()
        except OSError:
            self._seen = None  # look again at the next call
            return None
        if hashlib.sha256(data).hexdigest() == self._current().sha256:
            return None
        return self.reload_file(via="file_change")

    # -- POST /admission/policy --------------------------------------------------------------------

    def upload(self, body: bytes) -> ReloadRecord:
        """Validate, write to the policy file, apply. Raises :class:`UploadRefused` when nothing changed."""
        try:
            text = body.decode("utf-8")
            loaded = load_policy_text(text, "<POST /admission/policy>")
        except UnicodeDecodeError as e:
            message = f"<POST /admission/policy>: not UTF-8 text (byte {e.start})"
            self._record("upload", None, message)
            raise UploadRefused(422, "policy_invalid", message, [message]) from None
        except PolicyError as e:
            self._record("upload", None, str(e))
            raise UploadRefused(422, "policy_invalid", str(e), e.problems) from None
        except Exception as e:
            log.exception("policy reload via upload: unexpected error")
            message = _unexpected("<POST /admission/policy>", e)
            self._record("upload", None, message)
            raise UploadRefused(422, "policy_invalid", message, [message]) from None
        if self.path is None:
            return self._apply_or_refuse(loaded)
        target = Path(self.path).resolve()  # write through a symlink, never replace the link itself
        problem, tmp = _not_writable(target), None
        if problem is None:
            try:
                tmp = _write_beside(target, text)
            except OSError as e:
                problem = f"cannot be written ({e.strerror or e})"
        if tmp is None:
            message = (
                f"policy file {self.path} {problem}: an upload that is not in the file would be reverted "
                "by the next SIGHUP; change the file and send SIGHUP instead"
            )
            self._record("upload", None, message)
            raise UploadRefused(409, "policy_file_read_only", message, [message])
        try:
            record = self._apply_or_refuse(LoadedPolicy(loaded.policy, loaded.sha256, self.path))
        except UploadRefused:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        try:
            os.replace(tmp, target)
        except OSError as e:
            # Cannot happen after the checks above short of a race; never leave memory and file apart.
            with contextlib.suppress(OSError):
                tmp.unlink()
            if self._previous is not None:
                with contextlib.suppress(PolicyError):
                    self._apply(self._previous)
            message = f"policy file {self.path}: cannot replace it: {e.strerror or e}"
            self._record("upload", None, message)
            raise UploadRefused(409, "policy_file_read_only", message, [message]) from None
        return record

    def _apply_or_refuse(self, loaded: LoadedPolicy) -> ReloadRecord:
        self._previous = self._current()
        try:
            self._apply(loaded)
        except PolicyError as e:
            self._record("upload", None, str(e))
            raise UploadRefused(422, "policy_invalid", str(e), e.problems) from None
        except Exception as e:
            log.exception("policy reload via upload: unexpected error applying it")
            message = _unexpected(loaded.path or "<POST /admission/policy>", e)
            self._record("upload", None, message)
            raise UploadRefused(422, "policy_invalid", message, [message]) from None
        return self._record("upload", loaded, None)

    # -- records -----------------------------------------------------------------------------------

    def _record(self, via: str, loaded: LoadedPolicy | None, error: str | None) -> ReloadRecord:
        kept = self._current()
        if loaded is not None:
            rec = ReloadRecord(self._wall(), via, "applied", loaded.policy.name, loaded.sha256)
            log.info(
                "policy reload via %s: applied %s (sha256 %s)", via, loaded.policy.name, loaded.sha256[:12]
            )
        else:
            rec = ReloadRecord(self._wall(), via, "refused", kept.policy.name, kept.sha256, error)
            log.error(
                "policy reload via %s: refused, keeping %s (sha256 %s): %s",
                via,
                kept.policy.name,
                kept.sha256[:12],
                error,
            )
            self.last_failure = rec
        self.last_reload = rec
        self._on_attempt(loaded is not None)
        return rec

    def state(self) -> dict[str, object]:
        return {
            "last_reload": self.last_reload.as_dict() if self.last_reload else None,
            "last_failure": self.last_failure.as_dict() if self.last_failure else None,
        }


FileIdentity = tuple[str, int, int, int, int]


def file_identity(path: str) -> FileIdentity | None:
    """Where the file really is and which inode, modification time and size it has (None: missing)."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return (real, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _unexpected(source: str, e: Exception) -> str:
    text = str(e).split(";")[0][:200]
    return f"{source}:1: cannot be applied: {type(e).__name__}: {text}"


def _not_writable(target: Path) -> str | None:
    """A policy file marked read-only says "not here" even where this process could replace it."""
    if target.exists() and not os.access(target, os.W_OK):
        return "is not writable by this process"
    return None


def _write_beside(target: Path, text: str) -> Path:
    """The new content in a temporary file next to the target (same filesystem: the rename is atomic)."""
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".upload", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if target.exists():
            os.chmod(name, target.stat().st_mode & 0o7777)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    return Path(name)
