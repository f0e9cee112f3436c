#!/bin/bash
# The decision log on and off, same host, same GPU source (NVML): overhead.py's saturation phase with every
# server interleaved, 3 rounds each, log on then off.
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; nproc; nvidia-smi --query-gpu=name --format=csv,noheader; cat /proc/loadavg
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
TOOLS=$PWD/.devtools; SUMM=$PWD/summ.py  # = ../deferred-line-ab/summ.py; cd ..; export PYTHONPATH=$PWD
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
for L in /dev/null off; do
  N=on; [ $L = off ] && N=off
  T0=$(date +%s)
  timeout 260 python3 bench/overhead.py --quick --rounds 3 --floors uvicorn --only saturation --no-hold-queue --gpu-source nvml \
    --decision-log $L --tools-dir "$TOOLS" --machine "lent $CARD, decision log $N" --json "$OUT/log-$N.json" > "$OUT/log-$N.log" 2>&1
  echo "log $N rc $? in $(( $(date +%s) - T0 )) s"; python3 $SUMM "$OUT/log-$N.json"
  grep -E "^saturation (small|sse) " "$OUT/log-$N.log"
done
cat /proc/loadavg; date -u
