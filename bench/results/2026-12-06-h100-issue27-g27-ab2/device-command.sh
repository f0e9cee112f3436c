#!/bin/bash
# Issue 27, the A/B on one host: gate_profile.py (this tree against main 3dca0c2 in .dev-l2/base, children
# interleaved, the cheapest of 6 chunks per child), then overhead.py --quick of base and of this tree.
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; nproc
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
python3 -c "import tokenizers" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --find-links .whl tokenizers 2>&1 | grep -v -i warning | tail -1
BASE=$PWD/base; TOOLS=$PWD/.devtools
cd .. ; HERE=$PWD
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
T0=$(date +%s)
PYTHONPATH=$HERE timeout 160 python3 bench/gate_profile.py --base "$BASE" --rounds 9 --chunks 6 -n 3000 --out "$OUT/gate-profile.md" > "$OUT/gate-profile.log" 2>&1
echo "gate_profile rc $? in $(( $(date +%s) - T0 )) s"; sed -n 1,16p "$OUT/gate-profile.md"
for T in base main; do
  if [ $T = base ]; then D=$BASE; else D=$HERE; fi
  T0=$(date +%s)
  (cd $D && PYTHONPATH=$D timeout 180 python3 bench/overhead.py --quick --tools-dir "$TOOLS" --gpu-source nvml \
    --machine "lent $CARD host, $(nproc) cores" --json "$OUT/overhead-$T.json" > "$OUT/overhead-$T.log" 2>&1)
  echo "== $T overhead rc $? in $(( $(date +%s) - T0 )) s"
  grep -E "gate work per request|CPU per gated small request / floor|\(gated small / floor\)|CPU per pass-through request / nginx|64 streams at once|SSE CPU per event / nginx|^  floor-uvicorn  |^  floor  |^  sidecar  " "$OUT/overhead-$T.log" | head -12
done
date -u
