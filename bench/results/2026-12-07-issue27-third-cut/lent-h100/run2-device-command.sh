#!/bin/bash
# gate_profile A/B only (short budget): this tree against 2059c68 in .dev-l2/base, interleaved.
cd "$(dirname "$0")"
exec > >(tee "$OUT/device.log") 2>&1
date -u; python3 --version; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic pydantic-settings httptools orjson aiohttp uvloop granian hypercorn prometheus-client httpx pyyaml nvidia-ml-py numpy 2>&1 | grep -v -i warning | tail -3
python3 -c "import tokenizers" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --find-links .whl tokenizers 2>&1 | grep -v -i warning | tail -1
BASE=$PWD/base; TOOLS=$PWD/.devtools
cd .. ; HERE=$PWD; export PYTHONPATH=$HERE
python3 -c "import sidecar.app, granian, hypercorn, uvloop, aiohttp; print('imports ok')" || exit 3
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo GPU)
T0=$(date +%s)
timeout 150 python3 bench/gate_profile.py --base "$BASE" --labels after,before --rounds 7 --chunks 6 -n 3000 --out "$OUT/gate-profile.md" > "$OUT/gate-profile.log" 2>&1
echo "gate_profile rc $? in $(( $(date +%s) - T0 )) s"; sed -n 1,16p "$OUT/gate-profile.md"
T0=$(date +%s)
date -u
