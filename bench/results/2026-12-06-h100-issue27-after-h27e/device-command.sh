#!/bin/bash
# Issue 27 at main after h27e, in one call: overhead.py --quick (its table beside nginx and the floor, the quick
# hold queue), then bench/hold_queue.py at the issue's sizes (2,000 held, 10,000 arriving).
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; python3 --version; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
python3 -c "import tokenizers" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --find-links .whl tokenizers 2>&1 | grep -v -i warning | tail -1
cd .. ; export PYTHONPATH=$PWD
git log --oneline -1 2>/dev/null || true
python3 -c "import sidecar.app, granian, hypercorn, uvloop, aiohttp; print('imports ok')" || exit 3
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
T0=$(date +%s)
timeout 170 python3 bench/overhead.py --quick --tools-dir "$PWD/.dev-l2/.devtools" --gpu-source nvml \
  --machine "lent $CARD host, $(nproc) cores" --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
echo "overhead rc $? in $(( $(date +%s) - T0 )) s"; tail -70 "$OUT/overhead.log"
T1=$(date +%s)
timeout 100 python3 bench/hold_queue.py --budget-s 90 --json "$OUT/hold-queue.json" > "$OUT/hold-queue.log" 2>&1
echo "hold_queue rc $? in $(( $(date +%s) - T1 )) s"; tail -25 "$OUT/hold-queue.log"
date -u
