"""Which ``Host`` values a listener answers, and which bodies a gated path takes (SECURITY.md).

Why a Host check: a page on ``evil.example`` whose name is re-pointed at 127.0.0.1 (DNS rebinding)
makes the victim's browser talk to a loopback listener *same-origin*, so it can read
``/admission/state`` or spend the lane, and nothing about the TCP connection tells it apart. What does
tell it apart is the ``Host`` header, which carries the attacker's name. An IP literal or
``localhost`` cannot be rebound, so they are always accepted; any other name must be allow-listed.

Why JSON only on gated paths: a cross-site ``<form>`` or a ``fetch`` without preflight can only send
``text/plain``, ``application/x-www-form-urlencoded``, ``multipart/form-data`` or no Content-Type at all.
SGLang's OpenAI routes take exactly ``application/json``; its native ones (``/generate``...) also parse
a body with ``application/*+json`` or *no* Content-Type as JSON (evidence S23). The sidecar takes the
first two on every gated path and refuses the rest with 415, the absent type included (a browser sends
a Blob body with none), before the request can be held or forwarded.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from sidecar.http.answers import Response, error_response

LOOPBACK_NAMES = frozenset({"localhost"})


@dataclass(frozen=True, slots=True)
class HostCheck:
    """Names a listener answers to besides IP literals and ``localhost`` (lower case, no port).

    ``.example.com`` matches ``example.com`` and every name under it.
    """

    names: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, spec: str | Iterable[str]) -> HostCheck:
        items = spec.split(",") if isinstance(spec, str) else spec
        names = {n.strip().lower() for n in items} - {""}
        for n in names:
            if ":" in n or "/" in n:
                raise ValueError(f"allowed host {n!r}: give a host name, without scheme or port")
            if n == ".":
                raise ValueError("allowed host '.': give a domain after the dot")
        return cls(frozenset(names))

    def allows(self, host: str) -> bool:
        """``host`` is a Host header's value (``name[:port]`` or ``[v6]:port``)."""
        name = _host_name(host)
        if name is None:
            return False
        if name in LOOPBACK_NAMES or name.endswith(".localhost") or _is_ip(name):
            return True
        if name in self.names:
            return True
        return any(n.startswith(".") and (name == n[1:] or name.endswith(n)) for n in self.names)

    def refusal(self, headers: list[tuple[bytes, bytes]]) -> Response | None:
        """None when the request's Host is allowed; else the 400 (no or several Host) or 421 answer."""
        values = [v for k, v in headers if k == b"host"]
        if len(values) != 1:
            return error_response(
                400,
                "a request needs exactly one Host header" if values else "the request has no Host header",
                "invalid_host",
                type="invalid_request_error",
            )
        value = values[0].decode("latin-1")
        if self.allows(value):
            return None
        return error_response(
            421,
            f"this listener does not answer for Host {value[:100]!r}: use its IP address, localhost, or a "
            "name in --allowed-hosts",
            "host_not_allowed",
            type="invalid_request_error",
        )


# The admin port's default: IP literals and localhost, no other name.
LOCAL_NAMES_ONLY = HostCheck()


def _host_name(host: str) -> str | None:
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name.rstrip(".") or None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """A listen address that only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def json_media_refusal(value: bytes | None) -> Response | None:
    """None when the request's first Content-Type value (None: it sent none) is ``application/json`` or
    ``application/<x>+json``; else 415."""
    if value is not None:
        media = value.split(b";", 1)[0].strip().lower()
        if media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json")):
            return None
    got = "no Content-Type" if value is None else f"Content-Type {value.decode('latin-1')[:100]!r}"
    return error_response(
        415,
        f"this endpoint takes a JSON body: send Content-Type: application/json (got {got})",
        "unsupported_media_type",
        type="invalid_request_error",
    )
