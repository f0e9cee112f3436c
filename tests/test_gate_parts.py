"""``bench/gate_parts.py`` runs on the real app and reports every part (a bench that rots is a defect)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_gate_parts_times_every_part_of_a_real_gated_request(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import gate_parts

    out = tmp_path / "parts.json"
    assert gate_parts.main(["-n", "50", "--repeats", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    parts = got["parts_us"]
    assert set(parts) == {
        "parse", "count", "demand", "decide", "situation + decide", "handle", "request id",
        "admit headers", "handle, no decision log",
    }  # fmt: skip
    assert all(v > 0 for v in parts.values())
    summed = ("parse", "count", "demand", "handle", "request id", "admit headers")
    assert abs(got["sum_us"] - sum(parts[k] for k in summed)) < 1e-6
    printed = capsys.readouterr().out
    assert "a lower bound of the gate's work per request" in printed
