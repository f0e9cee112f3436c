#!/bin/bash
# Issue 27, thirteenth session: overhead.py --quick (the issue's table) on main (the decision line built
# after the loop's turn). Outputs straight under $OUT (three files).
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; python3 --version; nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cat /proc/loadavg; grep -m1 "model name" /proc/cpuinfo
speed() { python3 -c "import time; t=time.process_time(); sum(i*i for i in range(3_000_000)); print('cpu-speed probe', round(time.process_time()-t, 3), 's')"; }
speed
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
TOOLS=$PWD/.devtools; cd ..; export PYTHONPATH=$PWD
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
T0=$(date +%s)
timeout 285 python3 bench/overhead.py --quick --rounds 3 --floors uvicorn --tools-dir "$TOOLS" --gpu-source nvml \
  --machine "lent $CARD host, $(nproc) cores" --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
echo "overhead rc $? in $(( $(date +%s) - T0 )) s"; tail -48 "$OUT/overhead.log"
speed; cat /proc/loadavg; date -u
