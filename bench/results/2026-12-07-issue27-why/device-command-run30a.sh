#!/bin/bash
# Issue 27 on the lent host, twelfth session: the CPU-speed probe, bench/gate_parts.py (the gate's parts
# back to back: a lower bound of its work), the in-process A/B against f28f8bf (base), then
# overhead.py --quick (the issue's table on this tree).
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; python3 --version; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
uptime; cat /proc/loadavg; grep -m1 "model name" /proc/cpuinfo
speed() { python3 -c "import time; t=time.process_time(); sum(i*i for i in range(3_000_000)); print('cpu-speed probe', round(time.process_time()-t, 3), 's')"; }
speed
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
BASE=$PWD/base; TOOLS=$PWD/.devtools
cd .. ; HERE=$PWD; export PYTHONPATH=$HERE
python3 -c "import sidecar.app, granian, hypercorn, uvloop, aiohttp; print('imports ok')" || exit 3
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
timeout 60 python3 bench/gate_parts.py --json "$OUT/gate-parts.json"
T0=$(date +%s)
timeout 140 python3 bench/gate_profile.py --base "$BASE" --labels after,before --rounds 9 --chunks 6 -n 3000 --out "$OUT/gate-profile.md" > "$OUT/gate-profile.log" 2>&1
echo "gate_profile rc $? in $(( $(date +%s) - T0 )) s"; sed -n 1,12p "$OUT/gate-profile.md"
speed; cat /proc/loadavg
T0=$(date +%s)
timeout 285 python3 bench/overhead.py --quick --rounds 3 --floors uvicorn --tools-dir "$TOOLS" --gpu-source nvml \
  --machine "lent $CARD host, $(nproc) cores" --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
echo "overhead rc $? in $(( $(date +%s) - T0 )) s"; tail -45 "$OUT/overhead.log"
speed; cat /proc/loadavg; date -u
