#!/bin/bash
# Issue 27, thirteenth session: where the decision line is rendered, at saturation on the lent host.
# Trees: varT (main: on the writer thread), varI (inline in put), varL (on the loop, a batch per turn);
# off = varT with --decision-log off. Each run a fresh sidecar; three repetitions interleaved.
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; python3 --version; nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cat /proc/loadavg; grep -m1 "model name" /proc/cpuinfo
speed() { python3 -c "import time; t=time.process_time(); sum(i*i for i in range(3_000_000)); print('cpu-speed probe', round(time.process_time()-t, 3), 's')"; }
speed
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
TOOLS=$PWD/.devtools; HERE=$PWD
for rep in 1 2 3; do
  for v in varT varI varL off; do
    tree=$v; extra=""; [ $v = off ] && { tree=varT; extra="--decision-log off"; }
    (cd $HERE/$tree && PYTHONPATH=$PWD timeout 90 python3 bench/overhead.py --quick --only saturation --servers sidecar \
      --shapes small,small-passthrough --rounds 3 --seconds 2 --no-hold-queue --floors "" --tools-dir "$TOOLS" \
      --gpu-source nvml $extra --json "$OUT/$v-$rep.json" > "$OUT/$v-$rep.log" 2>&1; echo "$v-$rep rc $?")
    python3 - "$OUT/$v-$rep.json" <<'PY'
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
date -u
