#!/usr/bin/env bash
# Device script for the measurement issue (FlashKDA and FLA backends, kda.bench, tuned auto).
# Usage on the device machine (carry .device): bash benchmarks/device/session_measure.sh PHASE
#   prep   : route check; `python -m kda.verify --all` in parallel processes; and, at the same time, one
#            process per compile group running FLA alone, briefly, so that FLA compiles and autotunes every
#            bench shape (in parallel on the CPUs: about 250 s per group) and its first call (cold start,
#            under that load) is recorded. Timings from this phase are discarded: the GPU is shared.
#   bench  : `python -m kda.bench --tune` in ONE process on an otherwise idle GPU, every row re-measured,
#            FLA reading its autotune results from the cache the prep phase left
# State that later phases need (verification records, Triton autotune results) is left in $OUT/state.tgz;
# bring it back as .device/state.tgz and the next phase unpacks it first.
set -uo pipefail
PHASE=${1:?phase}
source .device/setup.sh
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1 KDA_CACHE_DIR=/tmp/kda-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$TRITON_CACHE_DIR" "$KDA_CACHE_DIR" "$OUT"
if [ -f .device/state.tgz ] && [ ! -f /tmp/.state-unpacked ]; then
  tar xzf .device/state.tgz -C /tmp && touch /tmp/.state-unpacked
fi
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "gpus=$GPUS"; nproc;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)';
  python3 -m pip list 2>/dev/null | grep -i -E "fla-core|flashkda|pydantic|rich|helion" ; } > "$OUT/env-$PHASE.txt" 2>&1

pack_state() {  # verification records + autotune results (small), for the next phase
  (cd /tmp && find triton-cache -name '*.autotune.json' > /tmp/autotune.list; tar czf "$OUT/state.tgz" kda-cache -T /tmp/autotune.list)
  ls -la "$OUT/state.tgz"
}

case "$PHASE" in
all)
  # One call, every step under its own deadline (their sum stays under the 600 s call limit):
  #  0-280 s  FLA compiles/tunes every bench group (fwd; training at B1_T8192_H96) in parallel processes,
  #           recording its first call per group (cold start, under load); kda.verify --quick runs beside;
  #  then     the measured bench in one process on the idle GPU (fwd: 12 shapes; training: B1_T8192_H96).
  mkdir -p "$OUT/warm"
  python3 -c 'from kda.bench.cli import compile_groups; from kda.bench.shapes import DEFAULT_SHAPES
for g in compile_groups(DEFAULT_SHAPES, 99): print(" ".join("--shape=" + s for s in g))' > /tmp/groups.txt
  n=0
  while read -r shapes; do
    n=$((n + 1))
    timeout ${WARM_TIMEOUT:-280} python3 -m kda.bench --backend baseline:fla $shapes --mode fwd --cold-start first \
      --warmup-ms 5 --rep-ms 20 --out "$OUT/warm/fwd$n" > "$OUT/warm/fwd$n.txt" 2>&1 &
  done < /tmp/groups.txt
  timeout ${WARM_TIMEOUT:-280} python3 -m kda.bench --backend baseline:fla --shape B1_T8192_H96_D128 --mode train_safe \
    --mode train_pregated --cold-start first --warmup-ms 5 --rep-ms 20 --out "$OUT/warm/train" > "$OUT/warm/train.txt" 2>&1 &
  timeout ${WARM_TIMEOUT:-280} python3 -m kda.verify --all --quick --with-bench-classes --jobs ${VERIFY_JOBS:-6} \
    --work-dir "$OUT/verify-work" --json "$OUT/verify-cuda-quick.json" > "$OUT/verify-cuda-quick.txt" 2>"$OUT/verify-cuda-quick.err"
  echo "verify rc=$?"; tail -8 "$OUT/verify-cuda-quick.txt"
  wait
  date -u
  MEASURED="--backend baseline:fla --backend baseline:flashkda --backend fla --backend flashkda --backend auto"
  timeout ${FWD_TIMEOUT:-190} python3 -m kda.bench --tune $MEASURED --mode fwd --cold-start first \
    --out "$OUT/bench-fwd" > "$OUT/bench-fwd.txt" 2>"$OUT/bench-fwd.err"
  echo "bench fwd rc=$?"; date -u
  timeout ${TRAIN_TIMEOUT:-70} python3 -m kda.bench --tune $MEASURED --shape B1_T8192_H96_D128 --mode train_pregated \
    --mode train_safe --cold-start none --out "$OUT/bench-train" > "$OUT/bench-train.txt" 2>"$OUT/bench-train.err"
  echo "bench train rc=$?"; date -u
  cp -r /tmp/kda-cache/timings "$OUT/timings" 2>/dev/null
  pack_state
  ;;
prep)
  timeout 120 python3 benchmarks/device/route_check.py > "$OUT/route-check.txt" 2>&1; echo "route_check rc=$?" >> "$OUT/route-check.txt"
  tail -8 "$OUT/route-check.txt"
  mkdir -p "$OUT/warm"
  python3 -c 'from kda.bench.cli import compile_groups; from kda.bench.shapes import DEFAULT_SHAPES
for g in compile_groups(DEFAULT_SHAPES, 99): print(" ".join("--shape=" + s for s in g))' > /tmp/groups.txt
  n=0
  while read -r shapes; do
    n=$((n + 1))
    timeout ${WARM_TIMEOUT:-500} python3 -m kda.bench --backend baseline:fla $shapes --cold-start first --warmup-ms 5 --rep-ms 20 \
      --out "$OUT/warm/group$n" > "$OUT/warm/group$n.txt" 2>&1 &
  done < /tmp/groups.txt
  timeout ${VERIFY_TIMEOUT:-500} python3 -m kda.verify --all --jobs ${VERIFY_JOBS:-8} --json "$OUT/verify-cuda.json" > "$OUT/verify-cuda.txt" 2>"$OUT/verify-cuda.err"
  echo "verify rc=$?"; tail -22 "$OUT/verify-cuda.txt"
  wait
  for f in "$OUT"/warm/group*.txt; do echo "== $f"; grep -E "wrote|error|Traceback" "$f" | head -3; done
  pack_state
  ;;
verify)
  timeout 120 python3 benchmarks/device/route_check.py > "$OUT/route-check.txt" 2>&1; echo "route_check rc=$?" >> "$OUT/route-check.txt"
  tail -8 "$OUT/route-check.txt"
  timeout ${VERIFY_TIMEOUT:-470} python3 -m kda.verify --all --jobs $((GPUS * 4)) --json "$OUT/verify-cuda.json" > "$OUT/verify-cuda.txt" 2>"$OUT/verify-cuda.err"
  echo "verify rc=$?"; tail -25 "$OUT/verify-cuda.txt"
  pack_state
  ;;
bench)
  BENCH_ARGS=${BENCH_ARGS:-}
  timeout ${BENCH_TIMEOUT:-540} python3 -m kda.bench --tune --jobs "$GPUS" --out "$OUT/bench" $BENCH_ARGS > "$OUT/bench.txt" 2>"$OUT/bench.err"
  echo "bench rc=$?"; tail -5 "$OUT/bench.err"; grep -E "error|->" "$OUT/bench.txt" | head -40
  cp -r /tmp/kda-cache/timings "$OUT/timings" 2>/dev/null
  pack_state
  ;;
esac
