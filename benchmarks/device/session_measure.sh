#!/usr/bin/env bash
# Device script for the measurement issue (fla and flashkda backends, kda.bench, tuned auto).
#
#   bash benchmarks/device/session_measure.sh PHASE        (on the device machine, carry [".device"])
#
# Phases (each fits one 600 s call; run them in this order, in one warm machine if possible):
#   verify  python -m kda.verify --all --with-bench-classes, spread over 14 processes (FLA compiles for
#           every new set of shapes; pinned autotuning keeps that to one configuration per kernel)
#   warm    FLA alone, one process per bench compile group, every mode, briefly: FLA compiles and
#           autotunes every bench shape in parallel on the CPUs, and each group's first call (cold
#           start, under that load) is recorded. Timings from this phase are discarded.
#   bench   python -m kda.bench --tune in ONE process on the idle GPU: every shape and mode, FLA reading
#           the autotune results the warm phase left (set BENCH_MODES / BENCH_SHAPES to narrow it)
#   triton  the triton backend: python -m kda.verify --backend triton over the grid and the bench classes
#           (8 processes), then its forward rows beside FLA's in one process
#
# Lessons of 2026-11-29: the call is killed at 600 s with everything unsaved, and at most 8 files come
# back. So every step runs under a deadline computed from one budget (DEADLINE_S, default 540 s), and
# everything is packed into $OUT/<phase>.tgz at the end; state that the next phase needs (verification
# records, timing table, Triton autotune results) goes to $OUT/state.tgz: copy it to .device/state.tgz.
set -uo pipefail
PHASE=${1:?phase}
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-540}
left() { echo $(( DEADLINE_S - ($(date +%s) - START) - ${1:-0} )); }   # seconds left, minus a reserve

source .device/setup.sh
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1 KDA_CACHE_DIR=/tmp/kda-cache
mkdir -p "$TRITON_CACHE_DIR" "$KDA_CACHE_DIR" "$OUT"
if [ -f .device/state.tgz ] && [ ! -f /tmp/.state-unpacked ]; then
  tar xzf .device/state.tgz -C /tmp && touch /tmp/.state-unpacked
fi
W=/tmp/work-$PHASE; rm -rf "$W"; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)';
  python3 -m pip list 2>/dev/null | grep -i -E "fla-core|flashkda|pydantic|rich|helion"; } > "$W/env.txt" 2>&1

finish() {
  (cd /tmp && find triton-cache -name '*.autotune.json' > /tmp/autotune.list; tar czf "$OUT/state.tgz" kda-cache -T /tmp/autotune.list)
  tar czf "$OUT/$PHASE.tgz" -C "$W" .
  ls -la "$OUT"
}

case "$PHASE" in
verify)
  timeout "$(left 30)" python3 -m kda.verify --all --with-bench-classes --jobs "${VERIFY_JOBS:-14}" \
    --work-dir "$W/workers" --json "$W/verify-cuda.json" > "$W/verify-cuda.txt" 2> "$W/verify-cuda.err"
  echo "verify rc=$?"; tail -6 "$W/verify-cuda.txt"
  ;;
warm)
  python3 -c 'from kda.bench.cli import compile_groups; from kda.bench.shapes import DEFAULT_SHAPES
for g in compile_groups(DEFAULT_SHAPES, 99): print(" ".join("--shape=" + s for s in g))' > "$W/groups.txt"
  n=0
  while read -r shapes; do
    n=$((n + 1))
    timeout "$(left 30)" python3 -m kda.bench --backend baseline:fla $shapes ${WARM_MODES:-} --cold-start first \
      --warmup-ms 5 --rep-ms 20 --out "$W/group$n" > "$W/group$n.txt" 2>&1 &
  done < "$W/groups.txt"
  wait
  grep -h "cold=" "$W"/group*.txt | grep -v "cold=None" | head -30
  ;;
bench)
  MEASURED="--backend baseline:fla --backend baseline:flashkda --backend fla --backend flashkda --backend auto"
  timeout "$(left 30)" python3 -m kda.bench --tune $MEASURED ${BENCH_MODES:-} ${BENCH_SHAPES:-} \
    --cold-start "${COLD:-first}" --out "$W/bench" > "$W/bench.txt" 2> "$W/bench.err"
  echo "bench rc=$?"; grep -E "auto:" "$W/bench.err" | head -40
  cp -r /tmp/kda-cache/timings "$W/timings" 2>/dev/null
  ;;
triton)
  export KDA_TRITON_EXPERIMENTAL=1  # the backend's first run on a GPU
  timeout "$(left 200)" python3 -m kda.verify --backend triton --with-bench-classes --jobs 8 \
    --work-dir "$W/verify-workers" --json "$W/verify-triton.json" > "$W/verify-triton.txt" 2> "$W/verify-triton.err"
  echo "verify triton rc=$?"; tail -4 "$W/verify-triton.txt"
  timeout "$(left 30)" python3 -m kda.bench --tune --backend baseline:fla --backend triton --backend fla --backend auto \
    --mode fwd --cold-start first --out "$W/bench-triton" > "$W/bench-triton.txt" 2> "$W/bench-triton.err"
  echo "bench triton rc=$?"; grep -E "triton:" "$W/bench-triton.err" | head -20
  ;;
*) echo "unknown phase $PHASE"; exit 2 ;;
esac
finish
