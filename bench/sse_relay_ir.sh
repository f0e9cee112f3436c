#!/bin/bash
# Instructions per SSE stream through a proxy, counted by cachegrind (bench/sse_relay_ir.py), and the
# relay's slope per event and intercept per stream from two stream lengths.
#   usage: bench/sse_relay_ir.sh KIND [SHORT LONG [R K [PER_TURN]]]    (KIND: sidecar | floor | direct)
# Per length: instructions of a run of R+K streams minus one of R (start-up, warm-up and shutdown
# cancel), divided by K. slope = (long - short) / (LONG - SHORT); intercept = short - SHORT * slope.
# PYTHONPATH picks the tree whose code runs; PYTHONHASHSEED fixed so dict and set orders repeat; one
# OpenBLAS thread (numpy, imported by the intake, starts spinning threads whose turns vary).
set -euo pipefail
KIND=$1; SHORT=${2:-100}; LONG=${3:-400}; R=${4:-5}; K=${5:-20}; PT=${6:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-$HERE/../.venv/bin/python}
ir() {  # events streams
    PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1 valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \
        "$PY" "$HERE/sse_relay_ir.py" "$KIND" "$1" "$2" --per-turn "$PT" 2>&1 \
        | grep -E "I\s+refs" | tr -d , | awk '{print $NF}'
}
# The four runs at once (each is one process; the counts do not depend on what else runs).
T=$(mktemp -d)
ir "$SHORT" "$R" >"$T/sa" & ir "$SHORT" $((R + K)) >"$T/sb" &
ir "$LONG" "$R" >"$T/la" & ir "$LONG" $((R + K)) >"$T/lb" &
wait
S=$(( ($(cat "$T/sb") - $(cat "$T/sa")) / K )); L=$(( ($(cat "$T/lb") - $(cat "$T/la")) / K ))
rm -rf "$T"
SLOPE=$(( (L - S) / (LONG - SHORT) )); ICPT=$(( S - SHORT * SLOPE ))
echo "$KIND tree=${PYTHONPATH:-?} per_turn=$PT Ir/stream: $SHORT ev $S, $LONG ev $L; slope $SLOPE Ir/event, intercept $ICPT Ir/stream"
