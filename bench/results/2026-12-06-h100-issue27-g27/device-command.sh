#!/bin/bash
# Issue 27 at main after the g27 round, in one call: overhead.py --quick (its table beside nginx and the floors),
# bench/hold_queue.py at the issue's sizes, then gate_profile.py: this tree against main 3dca0c2 (.dev-l2/base),
# CPU per request interleaved and one cProfile of the gated path per tree.
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; python3 --version; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
python3 -c "import tokenizers" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --find-links .whl tokenizers 2>&1 | grep -v -i warning | tail -1
BASE=$PWD/base
cd .. ; export PYTHONPATH=$PWD
python3 -c "import sidecar.app, granian, hypercorn, uvloop, aiohttp; print('imports ok')" || exit 3
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
T0=$(date +%s)
timeout 200 python3 bench/overhead.py --quick --tools-dir "$PWD/.dev-l2/.devtools" --gpu-source nvml \
  --machine "lent $CARD host, $(nproc) cores" --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
echo "overhead rc $? in $(( $(date +%s) - T0 )) s"; tail -75 "$OUT/overhead.log"
T1=$(date +%s)
timeout 100 python3 bench/hold_queue.py --budget-s 90 --json "$OUT/hold-queue.json" > "$OUT/hold-queue.log" 2>&1
echo "hold_queue rc $? in $(( $(date +%s) - T1 )) s"; tail -25 "$OUT/hold-queue.log"
T2=$(date +%s)
timeout 150 python3 bench/gate_profile.py --base "$BASE" --rounds 5 -n 3000 --out "$OUT/gate-profile.md" > "$OUT/gate-profile.log" 2>&1
echo "gate_profile rc $? in $(( $(date +%s) - T2 )) s"; head -40 "$OUT/gate-profile.md"; tail -5 "$OUT/gate-profile.log"
date -u
