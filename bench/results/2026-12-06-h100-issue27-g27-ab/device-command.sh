#!/bin/bash
# Issue 27, the A/B on one warm host: overhead.py --quick of main 3dca0c2 (.dev-l2/base), then of this tree,
# then gate_profile.py (this tree against base, interleaved, cheapest of 6 chunks per child).
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; nproc
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
python3 -c "import tokenizers" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --find-links .whl tokenizers 2>&1 | grep -v -i warning | tail -1
BASE=$PWD/base; TOOLS=$PWD/.devtools
cd .. ; HERE=$PWD; START=$(date +%s)
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
for T in base main base main; do
  if [ $T = base ]; then D=$BASE; else D=$HERE; fi
  T0=$(date +%s)
  (cd $D && PYTHONPATH=$D timeout 200 python3 bench/overhead.py --quick --tools-dir "$TOOLS" --gpu-source nvml \
    --machine "lent $CARD host, $(nproc) cores" --json "$OUT/overhead-$T-$T0.json" > "$OUT/overhead-$T-$T0.log" 2>&1)
  echo "== $T overhead rc $? in $(( $(date +%s) - T0 )) s"
  grep -E "gate work per request|CPU per gated small request / floor|\(gated small / floor\)|CPU per pass-through request / nginx|64 streams at once|SSE CPU per event / nginx|^  floor-uvicorn  |^  floor  |^  sidecar  " "$OUT/overhead-$T-$T0.log" | head -12
  [ $(( $(date +%s) - START )) -gt 400 ] 2>/dev/null && break
done
date -u
