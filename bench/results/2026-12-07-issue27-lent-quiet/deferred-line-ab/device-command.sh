#!/bin/bash
# A/B on the lent host: the decision line built on the writer's thread (this tree) against HEAD (base2),
# sidecar-only saturation rounds, interleaved twice; then this tree's full overhead.py --quick.
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; nproc; nvidia-smi --query-gpu=name --format=csv,noheader; cat /proc/loadavg
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
TOOLS=$PWD/.devtools; SUMM=$PWD/summ.py; NEW=$(cd .. && pwd); OLD=$PWD/base2
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
for r in 1 2; do for t in new old; do
  T=$NEW; [ $t = old ] && T=$OLD
  (cd $T && PYTHONPATH=$T timeout 100 python3 bench/overhead.py --quick --rounds 3 --floors uvicorn --only saturation --no-hold-queue --servers sidecar --gpu-source nvml --tools-dir "$TOOLS" --machine "lent $CARD, $t" --json "$OUT/ab-$t-$r.json" > "$OUT/ab-$t-$r.log" 2>&1); echo "$t $r rc $?"
  python3 $SUMM "$OUT/ab-$t-$r.json"
done; done
cat /proc/loadavg
cd $NEW; T0=$(date +%s)
PYTHONPATH=$NEW timeout 280 python3 bench/overhead.py --quick --rounds 3 --floors uvicorn --tools-dir "$TOOLS" --gpu-source nvml \
  --machine "lent $CARD host, $(nproc) cores" --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
echo "overhead rc $? in $(( $(date +%s) - T0 )) s"; tail -42 "$OUT/overhead.log"
date -u
