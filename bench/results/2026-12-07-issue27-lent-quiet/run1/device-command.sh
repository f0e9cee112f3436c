#!/bin/bash
# Issue 27 on the lent host, tenth session: overhead.py --quick with 3 interleaved saturation rounds (the
# issue's table, one run), then the in-process A/B against 2059c68, then overhead.py's saturation alone
# with the decision log off and the GPU source a file (the two differences from the in-process harness).
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; python3 --version; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
uptime; cat /proc/loadavg
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
BASE=$PWD/base; TOOLS=$PWD/.devtools
cd .. ; HERE=$PWD; export PYTHONPATH=$HERE
python3 -c "import sidecar.app, granian, hypercorn, uvloop, aiohttp; print('imports ok')" || exit 3
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
T0=$(date +%s)
timeout 300 python3 bench/overhead.py --quick --rounds 3 --floors uvicorn --tools-dir "$TOOLS" --gpu-source nvml \
  --machine "lent $CARD host, $(nproc) cores" --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
echo "overhead rc $? in $(( $(date +%s) - T0 )) s"; tail -45 "$OUT/overhead.log"
cat /proc/loadavg
T0=$(date +%s)
timeout 110 python3 bench/gate_profile.py --base "$BASE" --labels after,before --rounds 7 --chunks 6 -n 3000 --out "$OUT/gate-profile.md" > "$OUT/gate-profile.log" 2>&1
echo "gate_profile rc $? in $(( $(date +%s) - T0 )) s"; sed -n 1,16p "$OUT/gate-profile.md"
T0=$(date +%s)
timeout 150 python3 bench/overhead.py --quick --rounds 2 --floors uvicorn --only saturation --no-hold-queue --decision-log off \
  --tools-dir "$TOOLS" --machine "lent $CARD host, $(nproc) cores; decision log off, GPU file" --json "$OUT/overhead-nolog.json" > "$OUT/overhead-nolog.log" 2>&1
echo "overhead-nolog rc $? in $(( $(date +%s) - T0 )) s"; grep -E "^saturation (small|sse) " "$OUT/overhead-nolog.log"; grep "gate work" "$OUT/overhead-nolog.log"
date -u
