"""Soak: a few hundred concurrent clients through the sidecar against the engine emulator, on loopback.

Mixes streaming and non-streaming requests, long prompts that get held, prompts no lane can fit
(rejected), clients that leave while held or mid-stream, and a policy reload halfway. Samples the
process's RSS and open file descriptors every second and reports their slope over the second half.
Checks, at the end: outcomes recorded equal gated requests sent, ledger and hold queue at zero, the
emulator has no request left (none outlived its client). Stops by itself.

    python -m bench.soak                      # 10 minutes (make soak)
    python -m bench.soak --duration-s 60      # the short setting tests/test_soak.py runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from sidecar.admission.controller import Outcome
from sidecar.app import SidecarApp
from sidecar.http.server import ServingLimits, serve_app
from sidecar.policy.schema import load_policy_file
from sidecar.signals.gpu import parse_gpu_source
from sidecar_emulator.demo import scale_policy
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.server import EmulatorServer, build_emulator_app, build_model

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "sidecar_emulator" / "policies" / "maxq-qwen3next-bounded.yaml"
PROFILE = "maxq-bounded"
SPEED = 20.0  # emulator seconds per wall second: long prefills take a fraction of a second

# kind -> weight. Prompt sizes are the emulator's declared sizes (the sidecar runs with
# --trust-emulator-sizes, as for any load generation against the emulator).
KINDS = {"stream": 30, "plain": 25, "long": 15, "unfit": 10, "leave_held": 10, "leave_stream": 10}


@dataclass
class Report:
    duration_s: float
    clients: int
    sent: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    rss_mib: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    rss_slope_mib_per_min: float = 0.0
    fd_slope_per_min: float = 0.0
    ledger_after: int = -1
    held_after: int = -1
    engine_in_flight_after: int = -1
    reloads: int = 0

    @property
    def ok(self) -> bool:
        return (
            sum(self.outcomes.values()) == self.sent
            and self.ledger_after == 0
            and self.held_after == 0
            and self.engine_in_flight_after == 0
        )


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def slope_per_min(values: list[float]) -> float:
    """Least-squares slope over the second half of one-per-second samples, per minute."""
    ys = values[len(values) // 2 :]
    n = len(ys)
    if n < 3:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    num = sum((x - mx) * (y - my) for x, y in enumerate(ys))
    den = sum((x - mx) ** 2 for x in range(n))
    return 60 * num / den


async def client(
    url: str, session: aiohttp.ClientSession, rng: random.Random, deadline: float, r: Report
) -> None:
    kinds, weights = list(KINDS), list(KINDS.values())
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        tokens = {"long": 200_000, "unfit": 10_000_000, "leave_held": 200_000}.get(
            kind, rng.randint(200, 4000)
        )
        body = {
            "text": "x",
            "stream": kind in ("stream", "leave_stream", "long"),
            "sampling_params": {"max_new_tokens": rng.randint(4, 32)},
            "emulator": {"prompt_tokens": tokens},
        }
        r.sent += 1
        r.by_kind[kind] = r.by_kind.get(kind, 0) + 1
        try:
            if kind == "leave_held":
                status = await _leave_while_held(url, body, rng.uniform(0.02, 0.3))
            else:
                async with session.post(url + "/generate", json=body) as resp:
                    status = str(resp.status)
                    if kind == "leave_stream" and resp.status == 200:
                        await resp.content.readline()
                        status = "left mid-stream"
                    else:
                        await resp.read()
        except aiohttp.ClientError as e:
            status = type(e).__name__
        r.statuses[status] = r.statuses.get(status, 0) + 1
        await asyncio.sleep(rng.uniform(0.02, 0.2))  # think time: a client, not a flood


async def _leave_while_held(url: str, body: dict, after_s: float) -> str:
    """Send the whole request on a raw connection (so it surely arrives), then hang up."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /generate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(payload)
        + payload
    )
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.readline(), after_s)
        status = head.split(b" ")[1].decode() if head else "closed"
    except TimeoutError:
        status = "left"
    writer.close()
    return status


async def soak(duration_s: float, clients: int, seed: int = 7) -> Report:
    report = Report(duration_s=duration_s, clients=clients)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        gpu_file = Path(tmp) / "gpu.json"
        model = build_model(get_profile(PROFILE), seed=seed)
        async with EmulatorServer(build_emulator_app(model, SPEED, gpu_file)) as emu:
            policy = scale_policy(load_policy_file(POLICY), SPEED)
            app = SidecarApp(
                upstream=emu.url,
                policy=policy,
                gpu_source=parse_gpu_source(f"file:{gpu_file}"),
                trust_emulator_sizes=True,
                decision_log=open(os.devnull, "w"),  # noqa: SIM115
            )
            limits = ServingLimits(max_client_connections=4 * clients)
            connector = aiohttp.TCPConnector(limit=clients)
            timeout = aiohttp.ClientTimeout(total=120)
            async with (
                serve_app(app, limits=limits) as url,
                aiohttp.ClientSession(connector=connector, timeout=timeout) as s,
            ):
                while app.admission.snapshot.engine is None:
                    await asyncio.sleep(0.05)
                deadline = time.monotonic() + duration_s
                workers = [
                    asyncio.create_task(client(url, s, random.Random(rng.random()), deadline, report))
                    for _ in range(clients)
                ]
                reloaded = False
                while not all(w.done() for w in workers):
                    report.rss_mib.append(round(rss_mib(), 1))
                    report.fds.append(len(os.listdir("/proc/self/fd")))
                    if not reloaded and time.monotonic() > deadline - duration_s / 2:
                        app.apply_policy(policy)  # a reload under load: held requests are re-priced
                        report.reloads += 1
                        reloaded = True
                    await asyncio.wait(workers, timeout=1.0)
                for _ in range(200):  # the last releases and the emulator's aborts, bounded
                    if (
                        app.admission.ledger.totals.requests == 0
                        and app.admission.held == 0
                        and model.in_flight == 0
                    ):
                        break
                    await asyncio.sleep(0.05)
                report.ledger_after = app.admission.ledger.totals.requests
                report.held_after = app.admission.held
                report.engine_in_flight_after = model.in_flight
                for o in Outcome:
                    v = app.registry.get_sample_value("sglang_sidecar_requests_total", {"outcome": o.value})
                    if v:
                        report.outcomes[o.value] = int(v)
    report.rss_slope_mib_per_min = round(slope_per_min(report.rss_mib), 2)
    report.fd_slope_per_min = round(slope_per_min([float(f) for f in report.fds]), 2)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--clients", type=int, default=300)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", metavar="OUT", help="write the full report as JSON")
    args = p.parse_args(argv)
    r = asyncio.run(soak(args.duration_s, args.clients, args.seed))
    print(
        f"soak {r.duration_s:g} s, {r.clients} clients: {r.sent} gated requests, outcomes {r.outcomes} "
        f"(sum {sum(r.outcomes.values())}), statuses {r.statuses}"
    )
    print(
        f"RSS {r.rss_mib[0] if r.rss_mib else 0:.0f} -> {r.rss_mib[-1] if r.rss_mib else 0:.0f} MiB "
        f"(slope {r.rss_slope_mib_per_min:+.2f} MiB/min over the second half); fds {r.fds[0] if r.fds else 0} -> "
        f"{r.fds[-1] if r.fds else 0} (slope {r.fd_slope_per_min:+.2f}/min); after: ledger {r.ledger_after}, "
        f"held {r.held_after}, engine in flight {r.engine_in_flight_after}; {'OK' if r.ok else 'FAILED'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(r), indent=1))
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
