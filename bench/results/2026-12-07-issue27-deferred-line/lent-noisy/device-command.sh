#!/bin/bash
# Issue 27 on the lent host, eleventh session: the decision line built on the writer's thread (this tree)
# against f28f8bf (base). 1) overhead.py --quick, 3 interleaved rounds (the issue's table, one run);
# 2) the in-process A/B (gate_profile, fresh child per round, trees interleaved, gated/pass/sse);
# 3) overhead.py's saturation phase again in a new set of processes (the spread between processes).
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
timeout 285 python3 bench/overhead.py --quick --rounds 3 --floors uvicorn --tools-dir "$TOOLS" --gpu-source nvml \
  --machine "lent $CARD host, $(nproc) cores" --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
echo "overhead rc $? in $(( $(date +%s) - T0 )) s"; tail -45 "$OUT/overhead.log"
cat /proc/loadavg
T0=$(date +%s)
timeout 150 python3 bench/gate_profile.py --base "$BASE" --labels after,before --rounds 6 --chunks 6 -n 3000 --sse --out "$OUT/gate-profile.md" > "$OUT/gate-profile.log" 2>&1
echo "gate_profile rc $? in $(( $(date +%s) - T0 )) s"; sed -n 1,16p "$OUT/gate-profile.md"
cat /proc/loadavg
T0=$(date +%s)
timeout 105 python3 bench/overhead.py --quick --rounds 2 --floors uvicorn --only saturation --no-hold-queue \
  --tools-dir "$TOOLS" --gpu-source nvml --machine "lent $CARD host, $(nproc) cores; second processes" --json "$OUT/overhead-again.json" > "$OUT/overhead-again.log" 2>&1
echo "overhead-again rc $? in $(( $(date +%s) - T0 )) s"; grep -E "^saturation (small|sse) " "$OUT/overhead-again.log"; grep "gate work" "$OUT/overhead-again.log"
date -u
