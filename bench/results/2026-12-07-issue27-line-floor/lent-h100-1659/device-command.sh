#!/bin/bash
# Issue 27, fourteenth session: issue 27's table on main (overhead.py --quick: the decision line built after
# the loop's turn, 32 a turn at most), then the gate work with and without a decision log, a fresh sidecar
# per run, three each, interleaved (saturation, sidecar only).
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
J=$OUT/sat; mkdir -p $J
for rep in 1 2 3; do
  for v in log off; do
    extra=""; [ $v = off ] && extra="--decision-log off"
    [ $(( $(date +%s) - T0 )) -gt 490 ] && { echo "time up before $v-$rep"; break 2; }
    timeout 60 python3 bench/overhead.py --quick --only saturation --servers sidecar \
      --shapes small,small-passthrough --rounds 3 --seconds 2 --no-hold-queue --floors "" --tools-dir "$TOOLS" \
      --gpu-source nvml $extra --json "$J/$v-$rep.json" > "$J/$v-$rep.log" 2>&1; echo "$v-$rep rc $?"
    python3 - "$J/$v-$rep.json" <<'PY'
import json, sys
rows = {(r["path"], r["kind"]): r for r in json.load(open(sys.argv[1]))["rows"]}
g, p = rows[("sidecar", "small")], rows[("sidecar", "small-passthrough")]
us = lambda r: 1e3 * r["cpu_s_per_1000_requests"]
print(f"  {sys.argv[1].rsplit('/', 1)[-1]:14} gated {us(g):6.1f} {[round(1e3 * v, 1) for v in g['cpu_s_per_1000_requests_rounds']]} "
      f"pass {us(p):6.1f} gate work {us(g) - us(p):5.1f}  gated req/s {g['requests_per_s']:,.0f}")
PY
  done
  speed
done
(cd $OUT && tar czf sat.tgz sat && rm -rf sat)
date -u
