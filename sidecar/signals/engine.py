"""The SGLang engine adapter: scrape /metrics, /v1/loads and /server_info into `EngineSignals`.

Split in two so the version logic can be tested without a server:

* pure parsers (`parse_metrics`, `parse_loads`, `parse_server_info`) that map what one endpoint
  returned to `EngineSignals` field values, leaving out whatever the engine did not report;
* `EngineScraper`, the I/O shell (httpx, control plane only) that decides which endpoints to ask,
  notices engine restarts, and merges the three readings into one snapshot.

Version notes that drive the mapping (docs/evidence.md S2-S4, F4-F7):

* `sglang:token_usage` is `round(max(full, swa, mamba), 2)` from 0.5.14 on, so it is never used as a
  pool usage there. On 0.5.9 and older it is the full-attention usage (max(full, swa) for hybrid SWA,
  which is the conservative reading), and there is no `sglang:full_token_usage`.
* 0.5.14 added `full_token_usage`, `kv_*_tokens`, `mamba_*_tokens` (Mamba *state slots*, not tokens)
  and the startup constants `context_len`, `page_size`, `num_pages`. 0.5.1 has no Mamba or SWA gauges.
* A fresh 0.5.23 server publishes no load gauges for its first 30 s: absent is unknown, not 0.
* Recent prometheus_client renames samples to `sglang_...` when asked for OpenMetrics, so the scraper
  asks for the 0.0.4 text format; the parser still accepts the escaped names.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NoReturn, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sidecar.core.snapshot import EngineSignals, SourceHealth
from sidecar.signals.plausible import Implausible, check_engine_fields, describe
from sidecar.signals.worker import run_in_signal_thread

log = logging.getLogger(__name__)

# Plain text 0.0.4: an OpenMetrics Accept makes prometheus_client >= 0.23 escape `sglang:` to `sglang_`.
METRICS_ACCEPT = "text/plain; version=0.0.4"
DEFAULT_MAX_METRICS_BYTES = 8 * 1024 * 1024  # the policy's engine.max_metrics_bytes default

_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineSignals)) - {
    "observed_at",
    "sources",
    "prefill_counted_at",
    "pids",
}


class EngineUnavailable(Exception):
    """The engine could not be read: down, not SGLang, metrics disabled, or unparsable output."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ImplausibleReading(EngineUnavailable):
    """The engine answered with values that cannot be true (NaN, negative, absurdly large)."""

    def __init__(self, problems: list[Implausible]) -> None:
        super().__init__(describe(problems))
        self.problems = problems


# --------------------------------------------------------------------------------------------------
# Pure parsing
# --------------------------------------------------------------------------------------------------

# How one gauge combines across data-parallel ranks: each DP rank has its own requests and pool,
# so counts add up; a usage is a ratio, and the fullest rank is the one that fails first.
_SUM, _MAX, _MIN = "sum", "max", "min"

# EngineSignals field -> (SGLang gauge, how DP ranks combine, integer?)
_GAUGES: dict[str, tuple[str, str, bool]] = {
    "running_requests": ("sglang:num_running_reqs", _SUM, True),
    "queue_requests": ("sglang:num_queue_reqs", _SUM, True),
    "full_token_usage": ("sglang:full_token_usage", _MAX, False),
    "swa_token_usage": ("sglang:swa_token_usage", _MAX, False),
    "mamba_usage": ("sglang:mamba_usage", _MAX, False),
    "kv_used_tokens": ("sglang:kv_used_tokens", _SUM, True),
    "kv_available_tokens": ("sglang:kv_available_tokens", _SUM, True),
    "kv_evictable_tokens": ("sglang:kv_evictable_tokens", _SUM, True),
    "max_total_tokens": ("sglang:max_total_num_tokens", _SUM, True),
    "mamba_used_slots": ("sglang:mamba_used_tokens", _SUM, True),
    "mamba_available_slots": ("sglang:mamba_available_tokens", _SUM, True),
    "mamba_evictable_slots": ("sglang:mamba_evictable_tokens", _SUM, True),
    # A request must fit the smallest limit of any rank.
    "context_len": ("sglang:context_len", _MIN, True),
}

# Families that first appeared in 0.5.14, the release where `token_usage` became max over the pools.
# Any of them (even declared without samples) marks a server whose `token_usage` must not be read.
_V0514_MARKERS = frozenset(
    {
        "sglang:full_token_usage",
        "sglang:kv_used_tokens",
        "sglang:kv_available_tokens",
        "sglang:kv_evictable_tokens",
        "sglang:mamba_used_tokens",
        "sglang:context_len",
        "sglang:page_size",
        "sglang:num_pages",
    }
)

# The in-flight prefills' progress (core/overrun.py): a counter SGLang grows by every prefill batch's
# computed tokens (docs/evidence.md S24), one series per mode.
PREFILL_COUNTER = "sglang:realtime_tokens_total"

_MAMBA_FIELDS = ("mamba_usage", "mamba_used_slots", "mamba_available_slots", "mamba_evictable_slots")


@dataclass(frozen=True, slots=True)
class MetricsReading:
    """One parsed /metrics page: the EngineSignals values found, plus restart fingerprints.

    ``pids`` are the scheduler pids from `pid` labels (series in multiprocess mode `all`); they
    change when the engine restarts, as may ``fields["max_total_tokens"]``.
    """

    fields: dict[str, object]
    pids: frozenset[str]
    sglang_families: int
    # NaN/Inf samples of the gauges the gate reads (sidecar.signals.plausible).
    implausible: tuple[Implausible, ...] = ()


def _version_tuple(version: str | None) -> tuple[int, int, int] | None:
    """'0.5.9.post1' -> (0, 5, 9); None when the string is not a version."""
    if not version:
        return None
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _empty_pool(used: object, available: object, evictable: object = None) -> bool:
    """True when the engine reported a pool of zero slots (its way of saying there is none)."""
    return used is not None and available is not None and used == available == (evictable or 0) == 0


def _rank(label: str | None) -> int:
    """A `tp_rank` label as a number; no label is rank 0, a non-number sorts last."""
    if label is None:
        return 0
    return int(label) if label.isdigit() else 1 << 30


def _combine(values: Iterable[float], how: str) -> float:
    vals = list(values)
    if how == _SUM:
        return sum(vals)
    return max(vals) if how == _MAX else min(vals)


# Every sample name read_metrics looks at, in both spellings (`sglang:` and the OpenMetrics-escaped
# `sglang_`); the rest of the page (histograms, per-priority counters: ~95 % of its lines) is dropped
# before the real parser sees it, which makes a scrape ~10x cheaper.
_READ = frozenset(
    {name for name, _, _ in _GAUGES.values()}
    | {"sglang:token_usage", "sglang:num_used_tokens", PREFILL_COUNTER}
    | {f"sglang:swa_{kind}_tokens" for kind in ("used", "available", "evictable")}
)
_WANTED = _READ | {"sglang_" + n[len("sglang:") :] for n in _READ}


def _relevant_lines(text: str) -> str:
    """The page without the SGLang samples that are not read here.

    Kept: every ``# TYPE`` line (the families present decide the version when /server_info is
    silent, and tell an SGLang server from something else), the samples read, those with a ``pid``
    label (the restart fingerprint), and every line that is not an SGLang sample at all, so that
    garbage still reaches the parser and fails there.
    """
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            if line.startswith("# TYPE "):
                keep.append(line)
            continue
        if not line.startswith("sglang"):
            keep.append(line)
            continue
        brace, space = line.find("{"), line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        if line[:end] in _WANTED or 'pid="' in line:
            keep.append(line)
    keep.append("")
    return "\n".join(keep)


def read_metrics(text: str, *, version: str | None = None) -> MetricsReading:
    """Parse SGLang's /metrics text (0.5.1 to 0.5.23). Raises ValueError when it is not Prometheus text.

    Series selection: per DP rank, only the lowest ``tp_rank`` (``"0"``, or none): other TP ranks
    repeat it under --enable-metrics-for-all-schedulers. With DP attention the rank that reports for
    DP group N is not tp_rank 0, hence "lowest per DP rank" rather than "tp_rank 0". Only the
    ``priority=""`` total under priority scheduling; ``pid`` ignored. Within one DP rank, duplicate
    series (pipeline stages, stale pids) are views of the same requests and pool, so the largest is
    kept; across DP ranks counts are summed and usages maxed. Non-finite values (`fwd_occupancy`
    is NaN by default) are treated as not reported.
    ``version`` (from /server_info or /v1/loads), when known, settles which `token_usage` meaning
    applies; otherwise the families present decide.
    """
    try:
        families = list(text_string_to_metric_families(_relevant_lines(text)))
    except Exception as exc:  # the parser raises ValueError, but also IndexError etc. on odd input
        raise ValueError(f"not Prometheus text format: {exc}") from exc

    colon: dict[str, list[Any]] = {}
    escaped: dict[str, list[Any]] = {}
    declared: set[str] = set()
    for fam in families:
        if fam.name.startswith(("sglang:", "sglang_")):
            declared.add("sglang:" + fam.name[len("sglang:") :])
        for s in fam.samples:
            if s.name.startswith("sglang:"):
                colon.setdefault(s.name, []).append(s)
            elif s.name.startswith("sglang_"):
                # OpenMetrics negotiation escaped `sglang:` to `sglang_` (evidence F7).
                escaped.setdefault("sglang:" + s.name[len("sglang_") :], []).append(s)
    samples = {**escaped, **colon}
    declared.update(samples)

    pids = frozenset(s.labels["pid"] for group in samples.values() for s in group if s.labels.get("pid"))
    nonfinite: dict[str, Implausible] = {}

    def gauge(name: str, how: str, mode: str | None = None) -> float | None:
        # dp rank -> (tp rank, value): one series per DP rank, from its lowest TP rank.
        best: dict[str | None, tuple[int, float]] = {}
        for s in samples.get(name, ()):
            if s.labels.get("priority", "") != "":
                continue  # per-priority breakdown; the total is the priority="" series
            if mode is not None and s.labels.get("mode") != mode:
                continue
            value = float(s.value)
            if not math.isfinite(value):
                nonfinite.setdefault(name, Implausible(name, value, "not a finite number"))
                continue
            dp, tp = s.labels.get("dp_rank"), _rank(s.labels.get("tp_rank"))
            held = best.get(dp)
            if held is None or tp < held[0]:
                best[dp] = (tp, value)
            elif tp == held[0]:
                # Same rank twice (other pp ranks, a stale `pid`): the same state, keep the larger.
                best[dp] = (tp, max(held[1], value))
        return _combine((v for _, v in best.values()), how) if best else None

    out: dict[str, object] = {}
    for field, (name, how, is_int) in _GAUGES.items():
        value = gauge(name, how)
        if value is not None:
            out[field] = round(value) if is_int else value

    computed = gauge(PREFILL_COUNTER, _SUM, mode="prefill_compute")
    if computed is not None:
        out["prefill_computed_tokens"] = round(computed)
        # Builds that skip zero increments export no cache series until the first hit (the 0.5.23
        # fixture: compute and decode only). An absent one beside the compute series is 0 so far.
        cached = gauge(PREFILL_COUNTER, _SUM, mode="prefill_cache")
        out["prefill_cached_tokens"] = 0 if cached is None else round(cached)

    # Before 0.5.14 `token_usage` is the full-attention usage; from 0.5.14 on it mixes the pools.
    vt = _version_tuple(version)
    is_new = vt >= (0, 5, 14) if vt is not None else bool(declared & _V0514_MARKERS)
    if "full_token_usage" not in out and not is_new:
        legacy = gauge("sglang:token_usage", _MAX)
        if legacy is not None:
            out["full_token_usage"] = legacy
    if "kv_used_tokens" not in out and not is_new:
        # Same quantity under its pre-0.5.14 name: pool size - available - evictable.
        used = gauge("sglang:num_used_tokens", _SUM)
        if used is not None:
            out["kv_used_tokens"] = round(used)

    # SGLang exports the Mamba and SWA gauges as 0 for models without those pools (0.5.14+ tells by
    # the slot gauges). A pool of 0 slots is "no such pool", not "a full pool", which would refuse
    # every request on a dense model.
    mamba = [out.get(f) for f in _MAMBA_FIELDS[1:]]
    if _empty_pool(*mamba):
        for f in _MAMBA_FIELDS:
            out.pop(f, None)
    swa = [gauge(f"sglang:swa_{kind}_tokens", _SUM) for kind in ("used", "available", "evictable")]
    if _empty_pool(*swa):
        out.pop("swa_token_usage", None)

    return MetricsReading(
        fields=out,
        pids=pids,
        sglang_families=len(declared),
        implausible=tuple(nonfinite.values()),
    )


def parse_metrics(text: str, *, version: str | None = None) -> dict[str, object]:
    """EngineSignals field values found in a /metrics page; a field that was not reported is absent."""
    return read_metrics(text, version=version).fields


def _as_int(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    return round(value)


# EngineSignals field -> /v1/loads per-rank key.
_LOADS_KEYS = {
    "running_requests": "num_running_reqs",
    "queue_requests": "num_waiting_reqs",
    "pending_prefill_tokens": "num_waiting_uncached_tokens",
    "max_running_requests": "max_running_requests",
    "max_total_tokens": "max_total_num_tokens",
}


def parse_loads(obj: object) -> dict[str, object]:
    """EngineSignals values from `GET /v1/loads` JSON (0.5.9+), DP ranks summed.

    `token_usage` there is `round(kv_usage, 4)` and excludes Mamba, so it is deliberately not read.
    Raises ValueError when the document does not have the /v1/loads shape.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("loads"), list):
        raise ValueError('expected an object with a "loads" list')
    out: dict[str, object] = {}
    for field, key in _LOADS_KEYS.items():
        values = []
        for i, rank in enumerate(obj["loads"]):
            if not isinstance(rank, dict):
                raise ValueError(f"loads[{i}]: expected an object, got {type(rank).__name__}")
            v = _as_int(rank.get(key), f"loads[{i}].{key}")
            if v is not None:
                values.append(v)
        # A field counts only when every rank reported it: a partial sum would understate the load.
        if values and len(values) == len(obj["loads"]):
            out[field] = sum(values)
    if isinstance(obj.get("version"), str):
        out["version"] = obj["version"]
    return out


def parse_server_info(obj: object) -> dict[str, object]:
    """Lane constants from `GET /server_info` (older: `/get_server_info`).

    `max_running_requests` prefers what the schedulers actually use
    (`internal_states[*].effective_max_running_requests_per_dp`, summed over DP ranks) to the
    configured value, which is often null. `context_len` is `context_length` (the engine also
    reports `max_req_input_len`, slightly smaller, the longest accepted prompt).
    `chunked_prefill_size` is passed through as SGLang reports it (-1 means chunking disabled).
    """
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    out: dict[str, object] = {}
    states = obj.get("internal_states")
    states = [s for s in states if isinstance(s, dict)] if isinstance(states, list) else []

    if (v := _as_int(obj.get("chunked_prefill_size"), "chunked_prefill_size")) is not None:
        out["chunked_prefill_size"] = v

    effective = [
        _as_int(s.get("effective_max_running_requests_per_dp"), "effective_max_running_requests_per_dp")
        for s in states
    ]
    if states and all(v is not None for v in effective):
        out["max_running_requests"] = sum(v for v in effective if v is not None)
    elif (v := _as_int(obj.get("max_running_requests"), "max_running_requests")) is not None:
        out["max_running_requests"] = v

    if (v := _as_int(obj.get("context_length"), "context_length")) is not None:
        out["context_len"] = v

    capacities = [
        _as_int(s["memory_usage"].get("token_capacity"), "memory_usage.token_capacity")
        if isinstance(s.get("memory_usage"), dict)
        else None
        for s in states
    ]
    if states and all(v is not None for v in capacities):
        out["max_total_tokens"] = sum(v for v in capacities if v is not None)
    elif (v := _as_int(obj.get("max_total_num_tokens"), "max_total_num_tokens")) is not None:
        out["max_total_tokens"] = v

    tp = _as_int(obj.get("tp_size"), "tp_size")
    if tp is not None and tp > 0:
        pp = _as_int(obj.get("pp_size"), "pp_size")
        out["gpus"] = tp * (pp if pp is not None and pp > 0 else 1)

    if isinstance(obj.get("version"), str):
        out["version"] = obj["version"]
    return out


def _model_paths(obj: object) -> tuple[str, ...]:
    """Where /server_info says the engine's tokenizer lives (``tokenizer_path`` first), deduplicated."""
    if not isinstance(obj, dict):
        return ()
    found = [obj.get(k) for k in ("tokenizer_path", "model_path")]
    return tuple(dict.fromkeys(p for p in found if isinstance(p, str) and p))


# --------------------------------------------------------------------------------------------------
# HTTP shell
# --------------------------------------------------------------------------------------------------


def make_control_client(timeout_s: float = 2.0, max_connections: int = 4) -> httpx.AsyncClient:
    """An httpx client for control-plane polling (one pool per caller: the scraper's is its own).

    `trust_env=False`: HTTP(S)_PROXY would otherwise apply even to localhost. Cookies are refused
    (a shared client would replay them). No redirects: a redirect means the URL points at something
    other than SGLang's own port, which should be an error, not followed silently.
    """
    jar = http.cookiejar.CookieJar(policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    return httpx.AsyncClient(
        trust_env=False,
        follow_redirects=False,
        cookies=jar,
        timeout=httpx.Timeout(timeout_s, connect=min(1.0, timeout_s)),
        limits=httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=min(2, max_connections),
            keepalive_expiry=2.0,
        ),
    )


def _describe_http_error(url: str, exc: httpx.HTTPError, base_url: str) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"GET {url}: cannot connect ({exc or type(exc).__name__}) — is SGLang running at {base_url}?"
    if isinstance(exc, httpx.TimeoutException):
        return f"GET {url}: timed out ({type(exc).__name__}) — the engine may be wedged or overloaded"
    return f"GET {url}: {type(exc).__name__}: {exc}"


def _decode_and_read(body: bytes, version: str | None) -> tuple[MetricsReading, bool]:
    """Decode and parse a /metrics body (run in a worker thread); also says whether it was blank."""
    text = body.decode("utf-8", errors="replace")
    return read_metrics(text, version=version), not text.strip()


# A JSON answer this large is parsed on the pollers' thread, not the loop's: SGLang's /server_info is
# ~46 KB (0.5.23, the whole server_args), ~0.8 ms of ``json.loads`` on the 2-core development machine,
# read at start-up and after every engine restart, when a burst of held requests is often waiting.
# A small one (/v1/loads, ~1.5 KB, ~0.1 ms) is parsed in place: the hop to a thread costs about as much
# (docs/evidence.md QD5).
JSON_OFF_LOOP_BYTES = 16 * 1024


def json_of(content: bytes) -> object:
    """A JSON body (``httpx.Response.json``'s parse: the encoding detected from the bytes)."""
    return json.loads(content)


def _describe_status(url: str, resp: httpx.Response) -> str:
    msg = f"GET {url}: {resp.status_code} {resp.reason_phrase}".rstrip()
    if resp.is_redirect:
        msg += f" to {resp.headers.get('location', '?')} — point the sidecar at SGLang's own port"
    return msg


T = TypeVar("T")
ExpectedErrors = tuple[type[BaseException], ...]


class Pacing:
    """When a poller reads next: every poll interval, and while the gate wants reports
    (``Admission.report_wanted``) also ``gap_s`` after the last read it asked for, however soon that
    is after a periodic read: at most ``1 / gap_s`` such reads a second beside the periodic ones, and
    the first one at once. The live pollers and ``replay``'s follow this one rule."""

    def __init__(self) -> None:
        self.last = -math.inf  # when the last read began
        self.last_sooner = -math.inf  # when the last read the gate asked for began

    def next_read(self, interval_s: float, gap_s: float, wanted: bool) -> tuple[float, bool]:
        """(when the next read is due, whether it is one the gate asked for); ``gap_s`` 0: never."""
        periodic = self.last + interval_s
        sooner = self.last_sooner + gap_s
        if wanted and gap_s > 0 and sooner < periodic:
            return sooner, True
        return periodic, False

    def began(self, t: float, sooner: bool) -> None:
        self.last = t
        if sooner:
            self.last_sooner = t


# How often the pollers read while the gate is idle (``idle_poll_interval``), at most. A scrape of
# SGLang's /metrics costs the sidecar ~6 ms of CPU (a 50 KB exposition parsed: ~12 ms per second at a
# 0.5 s interval) and a GPU reading with its snapshot ~0.5 ms (~5 ms per second at 0.1 s), to learn
# nothing while nothing of the gate's runs (bench/hold_queue.py, issue #27). The GPU's is shorter:
# between requests it is what sees a neighbour's growth.
IDLE_ENGINE_POLL_S = 5.0
IDLE_GPU_POLL_S = 0.5


def idle_poll_interval(interval_s: float, max_age_s: float, ceiling_s: float) -> float:
    """How often to read a signal while the gate is idle: ``ceiling_s``, but within half the signal's
    ``max_age_s`` (a reading never goes stale meanwhile: the first request after an idle spell is
    decided on one no older than the policy allows) and never faster than ``interval_s``."""
    return max(interval_s, min(ceiling_s, max_age_s / 2))


class Sooner:
    """A poller's reads sooner than its interval, while the gate wants them.

    A held request goes in at the first engine report that shows the room an ended request left, and
    SGLang publishes that room only at its next report (at once when it goes idle, else after its next
    prefill batch or within ``--decode-log-interval`` decode steps: docs/evidence.md S27), which the
    periodic poll reads up to a whole interval late. ``wanted`` and ``gap_s`` are read at every wait;
    ``nudge`` wakes a poller that is waiting out a longer interval. One poller is one task: never two
    reads at once, and any number of nudges during a read make at most one more read after it.
    """

    def __init__(
        self, wanted: Callable[[], bool] = lambda: False, gap_s: Callable[[], float] = lambda: 0.0
    ) -> None:
        self.wanted = wanted
        self.gap_s = gap_s
        self.pacing = Pacing()
        self.reads = 0  # reads the gate asked for
        self._event = asyncio.Event()

    def nudge(self) -> None:
        """The gate wants a report now (call on the poller's event loop)."""
        self._event.set()


async def poll_forever(
    read: Callable[[], Awaitable[T]],
    on_update: Callable[[T | None, SourceHealth], None],
    *,
    interval_s: float | Callable[[], float],
    clock: Callable[[], float],
    name: str,
    expected: ExpectedErrors = (),
    sooner: Sooner | None = None,
) -> NoReturn:
    """Call ``read`` every ``interval_s`` and report each attempt; never dies except by cancellation.

    ``interval_s`` may be a callable, read before each sleep, so a policy reload changes the cadence.
    With ``sooner``, reads also come sooner while the gate wants them (``Pacing``).

    A failed read reports ``None`` with the previous ``last_ok_at`` kept, so the gate can tell a
    stale-but-known signal from a source that never answered. ``expected`` errors are logged as one
    line (once per distinct message, not every tick); anything else gets a traceback.
    """
    health = SourceHealth()
    last_logged: str | None = None
    asked = False
    while True:
        started = clock()
        if sooner is not None:
            sooner._event.clear()  # a nudge from now on asks for the read after this one
            sooner.pacing.began(started, asked)
            sooner.reads += asked
        value: T | None = None
        try:
            value = await read()
        except Exception as exc:
            message = str(exc) or type(exc).__name__
            if not isinstance(exc, expected):
                log.exception("%s: unexpected error while polling", name)
            elif message != last_logged:
                log.warning("%s: %s", name, message)
            last_logged = message
            health = SourceHealth(
                last_ok_at=health.last_ok_at,
                last_error=message,
                consecutive_failures=health.consecutive_failures + 1,
            )
        else:
            if health.consecutive_failures:
                log.info("%s: recovered after %d failed reads", name, health.consecutive_failures)
            last_logged = None
            health = SourceHealth(last_ok_at=clock(), last_error=None, consecutive_failures=0)
        try:
            on_update(value, health)
        except Exception:
            log.exception("%s: on_update callback failed", name)
        if sooner is None:
            interval = interval_s() if callable(interval_s) else interval_s
            await asyncio.sleep(max(0.0, interval - (clock() - started)))
        else:
            asked = await _wait_for_next(interval_s, clock, sooner)


async def _wait_for_next(
    interval_s: float | Callable[[], float], clock: Callable[[], float], sooner: Sooner
) -> bool:
    """Until the next read is due (``Pacing``); a nudge makes it due again with what is wanted then.
    True when the read is one the gate asked for."""
    while True:
        interval = interval_s() if callable(interval_s) else interval_s
        due, asked = sooner.pacing.next_read(interval, sooner.gap_s(), sooner.wanted())
        delay = due - clock()
        if delay <= 0:
            return asked
        try:
            async with asyncio.timeout(delay):
                await sooner._event.wait()
        except TimeoutError:
            return asked
        sooner._event.clear()


def _series_name(source: str, field: str) -> str:
    """The engine's own name of a field's source: what an operator greps for."""
    if source == "metrics" and field in _GAUGES:
        return _GAUGES[field][0]
    if source == "loads":
        return "/v1/loads " + _LOADS_KEYS.get(field, field)
    return f"/{source} {field}"


class EngineScraper:
    """Polls one SGLang server and merges its endpoints into `EngineSignals`.

    Per poll: `/metrics` (required), `/v1/loads` (0.5.9+; a 404 is remembered and not asked again
    until the engine restarts), and `/server_info` (falls back to `/get_server_info` on 404), which
    is fetched at start and after a restart only, because it round-trips to every scheduler.
    A restart is noticed as a failed scrape followed by a successful one, or a changed scheduler
    `pid` label or pool size (`max_total_num_tokens`).

    Where endpoints overlap, /v1/loads wins over /metrics (its snapshot is refreshed every 15 decode
    steps instead of 40), and both win over /server_info (read once).
    """

    def __init__(
        self,
        base_url: str,
        client: httpx.AsyncClient | None = None,
        *,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        api_key: str | None = None,
        max_metrics_bytes: int = DEFAULT_MAX_METRICS_BYTES,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL must start with http:// or https://, got {base_url!r}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.base_url = base_url.rstrip("/")
        self.interval_s = interval_s
        # Read from the policy before each scrape (a reload changes it); over it, the scrape fails.
        self.max_metrics_bytes = max_metrics_bytes
        # What /server_info says the engine loaded (tokenizer_path, model_path), best first: the
        # app looks there for a tokenizer.json to count prompts with.
        self.model_paths: tuple[str, ...] = ()
        self._clock = clock
        self._owns_client = client is None
        self._client = client if client is not None else make_control_client()
        # Only for /v1/loads and /server_info: SGLang always lets /metrics through --api-key.
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loads_supported: bool | None = None  # None: not probed since the engine (re)started
        self._server_info_path = "/server_info"
        self._server_info: dict[str, object] | None = None
        self._need_server_info = True
        self._failed_since_last_ok = False
        # Restart fingerprints: scheduler pids (`pid` labels) and the KV pool size.
        self._pids: frozenset[str] = frozenset()
        self._pool: object = None
        self._version: str | None = None  # from /v1/loads or /server_info; settles token_usage meaning
        # Series whose values could not be true in the last reading (shown in /admission/state), and
        # a hook that counts each one.
        self.last_implausible: tuple[str, ...] = ()
        self.on_implausible: Callable[[str], None] = lambda series: None
        # Called with the reason when the engine is noticed to have restarted (a new process: new
        # scheduler pids, a new pool, or back after failed scrapes without the old pids).
        self.on_engine_changed: Callable[[str], None] = lambda why: None
        # Reads sooner than ``interval_s`` while the gate wants them (the app wires it to the gate).
        self.sooner: Sooner | None = None
        # While ``idle()`` (nothing admitted or held, nothing arriving: the app asks the gate), reads
        # every ``idle_interval_s`` instead (``idle_poll_interval``); a nudge on ``sooner`` ends the wait.
        self.idle: Callable[[], bool] = lambda: False
        self.idle_interval_s: float | None = None

    async def aclose(self) -> None:
        """Close the HTTP client if this scraper created it (an injected one belongs to the caller)."""
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> EngineScraper:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _engine_changed(self, why: str, *, new_process: bool = True) -> None:
        log.info(
            "engine at %s changed (%s): re-reading /server_info, re-probing /v1/loads", self.base_url, why
        )
        self._loads_supported = None
        self._server_info_path = "/server_info"
        self._need_server_info = True
        # The old engine's constants may no longer hold: unknown until re-read, never guessed.
        self._server_info = None
        self._version = None
        if new_process:
            self.on_engine_changed(why)

    async def _get(self, path: str, headers: Mapping[str, str]) -> tuple[str, httpx.Response]:
        url = self.base_url + path
        try:
            return url, await self._client.get(url, headers=dict(headers))
        except httpx.HTTPError as exc:
            raise EngineUnavailable(_describe_http_error(url, exc, self.base_url)) from exc

    async def _get_bounded(
        self, path: str, headers: Mapping[str, str], limit: int
    ) -> tuple[str, httpx.Response, bytes]:
        """GET ``path``; (url, response, body). A body over ``limit`` bytes is an error, not read on."""
        url = self.base_url + path
        try:
            async with self._client.stream("GET", url, headers=dict(headers)) as resp:
                declared = resp.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise EngineUnavailable(
                        f"GET {url}: {int(declared):,} bytes, over the {limit:,}-byte bound"
                        " (policy engine.max_metrics_bytes)"
                    )
                chunks, size = [], 0
                async for chunk in resp.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise EngineUnavailable(
                            f"GET {url}: over the {limit:,}-byte bound after {size:,} bytes"
                            " (policy engine.max_metrics_bytes)"
                        )
                    chunks.append(chunk)
                return url, resp, b"".join(chunks)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(_describe_http_error(url, exc, self.base_url)) from exc

    async def _read_metrics(self) -> MetricsReading:
        url, resp, body = await self._get_bounded(
            "/metrics", {"Accept": METRICS_ACCEPT, "Accept-Encoding": "identity"}, self.max_metrics_bytes
        )
        if resp.status_code == 404:
            raise EngineUnavailable(f"GET {url}: 404 — is SGLang started with --enable-metrics?")
        if resp.status_code != 200:
            raise EngineUnavailable(_describe_status(url, resp))
        try:
            # Off the event loop (even filtered, a page is 1-4 ms of pure Python every poll), on the
            # pollers' own threads: never queued behind a request's parse or tokenization.
            reading, blank = await run_in_signal_thread(_decode_and_read, body, self._version)
        except ValueError as exc:
            raise EngineUnavailable(f"GET {url}: the response is not Prometheus text ({exc})") from exc
        if blank:
            raise EngineUnavailable(f"GET {url}: empty answer — the engine's metrics exporter is broken")
        if reading.sglang_families == 0:
            raise EngineUnavailable(
                f"GET {url}: Prometheus text without any sglang: metric"
                f" — is {self.base_url} an SGLang server?"
            )
        return reading

    async def _get_json(self, path: str) -> tuple[str, httpx.Response, object]:
        url, resp = await self._get(path, {"Accept": "application/json", **self._auth})
        if resp.status_code != 200:
            return url, resp, None
        try:
            if len(resp.content) < JSON_OFF_LOOP_BYTES:
                return url, resp, json_of(resp.content)
            return url, resp, await run_in_signal_thread(json_of, resp.content)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise EngineUnavailable(f"GET {url}: invalid JSON ({exc})") from exc

    async def _read_loads(self) -> dict[str, object] | None:
        """/v1/loads values, or None when unavailable; optional, so failures only log."""
        if self._loads_supported is False:
            return None
        try:
            url, resp, body = await self._get_json("/v1/loads")
            if resp.status_code in (401, 403, 404):
                self._loads_supported = False
                log.info(
                    "GET %s: %d — not using /v1/loads until the engine restarts%s",
                    url,
                    resp.status_code,
                    " (SGLang older than 0.5.9?)" if resp.status_code == 404 else " (needs an API key)",
                )
                return None
            if resp.status_code != 200:
                log.warning("%s; using /metrics only for this poll", _describe_status(url, resp))
                return None
            values = parse_loads(body)
        except (EngineUnavailable, ValueError) as exc:
            log.warning("/v1/loads unusable this poll: %s", exc)
            return None
        self._loads_supported = True
        if isinstance(version := values.get("version"), str):
            self._version = version
        return values

    async def _read_server_info(self) -> None:
        """Refresh the cached lane constants; failures leave the request pending for the next poll."""
        try:
            url, resp, body = await self._get_json(self._server_info_path)
            if resp.status_code == 404 and self._server_info_path == "/server_info":
                self._server_info_path = "/get_server_info"  # before 0.5.9
                url, resp, body = await self._get_json(self._server_info_path)
            if resp.status_code == 404:
                self._need_server_info = False  # neither path exists: ask again after a restart
                log.warning("%s; running without server info until the engine restarts", url)
                return
            if resp.status_code != 200:
                log.warning("%s; will retry on the next poll", _describe_status(url, resp))
                return
            self._server_info = parse_server_info(body)
            self.model_paths = _model_paths(body)
            if isinstance(version := self._server_info.get("version"), str):
                self._version = version
        except (EngineUnavailable, ValueError) as exc:
            log.warning("server info unusable, will retry on the next poll: %s", exc)
            return
        self._need_server_info = False

    async def poll_once(self) -> EngineSignals:
        """Read the engine once. Raises `EngineUnavailable` when /metrics cannot be read."""
        # The page's counters are no older than the request for it (the poll's end can be much later).
        requested_at = self._clock()
        try:
            reading = await self._read_metrics()
        except Exception:
            self._failed_since_last_ok = True
            raise
        observed_at = self._clock()

        pids, pool = reading.pids, reading.fields.get("max_total_tokens")
        if self._failed_since_last_ok:
            # The same scheduler pids as before the failure: the same process, only a lost scrape.
            same = bool(pids) and pids == self._pids
            self._engine_changed("it answered again after a failed scrape", new_process=not same)
            if not same:
                # A new process: the old one's pids are no fingerprint of it (a fresh server publishes
                # its pid-labelled gauges only later, and that is no second restart).
                self._pids = frozenset()
        elif self._pids and pids and pids != self._pids:
            self._engine_changed(f"scheduler pid {sorted(self._pids)} -> {sorted(pids)}")
        elif self._pool is not None and pool is not None and pool != self._pool:
            self._engine_changed(f"KV pool {self._pool} -> {pool} tokens")
        self._failed_since_last_ok = False
        # Keep what is known: a fresh server does not publish the pid-labelled gauges yet.
        self._pids = pids or self._pids
        self._pool = pool if pool is not None else self._pool

        loads = await self._read_loads()
        if self._need_server_info:
            await self._read_server_info()

        merged: dict[str, object] = {}
        series: dict[str, str] = {}
        sources: list[str] = []
        for name, part in (("server_info", self._server_info), ("metrics", reading.fields), ("loads", loads)):
            if part is None:
                continue
            merged.update({k: v for k, v in part.items() if k in _ENGINE_FIELDS})
            series.update({k: _series_name(name, k) for k in part if k in _ENGINE_FIELDS})
            sources.append(name)
        problems = [*reading.implausible, *check_engine_fields(merged, series)]
        self.last_implausible = tuple(p.series for p in problems)
        if problems:
            for p in problems:
                self.on_implausible(p.series)
            raise ImplausibleReading(problems)
        counted_at = requested_at if "prefill_computed_tokens" in merged else None
        return EngineSignals(
            observed_at=observed_at,
            sources=tuple(sources),
            prefill_counted_at=counted_at,
            pids=tuple(sorted(pids)),
            **merged,  # type: ignore[arg-type]
        )

    def current_interval_s(self) -> float:
        """``interval_s``, or ``idle_interval_s`` while the gate is idle (read before every wait)."""
        idle = self.idle_interval_s
        return idle if idle is not None and self.idle() else self.interval_s

    async def run(self, on_update: Callable[[EngineSignals | None, SourceHealth], None]) -> NoReturn:
        """Poll forever at ``current_interval_s``; report every attempt. Stop it by cancelling the task."""
        await poll_forever(
            self.poll_once,
            on_update,
            interval_s=self.current_interval_s,
            clock=self._clock,
            name=f"engine {self.base_url}",
            expected=(EngineUnavailable,),
            sooner=self.sooner,
        )
