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
#   probe   the triton backend's first GPU run, every backend's verification, a forward bench (see below)
#   pair    (nvidia-h200-x2) verification on GPU 1 beside stages, config sweep and bench on GPU 0
#   last    (one GPU) triton stages, config sweep, forward bench at a few shapes, one training shape
#   next, next-train   (nvidia-h200-x2) what the next session should run, in two calls: see the phases
#   s4      (nvidia-h200-x2) session 4: verify triton (GPU 1); stages, ncu, forward bench, sweep (GPU 0)
#   s4b     (nvidia-h200-x2) session 4's second call: quick verify + training bench (GPU 1); stages, sweep,
#           forward bench at eight shapes (GPU 0)
#   s4c     (one GPU) session 4's third call: K = 256 stages and sweep, forward bench at every shape
#   s4d     (one GPU) session 4's last call: the final kernels verified on the bench's classes
#   next5   (nvidia-h200-x2) for session 5: the grid (GPU 1); stages, sweep, pre-gated forward and
#           training benches (GPU 0)
#   s5      (nvidia-h200-x2) session 5, call 1: an experimental version 5 (gate folded into intra and
#           output, score blocks in registers; branch experiment/v5-blocks-in-registers, not on main):
#           verify triton's forward (GPU 1); stages, sweep, forward benches (GPU 0)
#   s5b     (nvidia-h200-x2) session 5, call 2, version 6: the whole grid with training (GPU 1); stages,
#           sweep, forward and pre-gated forward benches, one training shape (GPU 0)
#   s5c     (nvidia-h200-x2) session 5, call 3, version 7 (intra at 2 warps): the grid again (GPU 1);
#           stages, the intra warps at K = 256, the forward bench with auto (GPU 0)
#   s5d     (nvidia-h200-x2) session 5, call 4, version 8 (intra at 2 warps at every K): the grid (GPU 1);
#           the forward bench with --tune, so that auto learns where triton is fastest (GPU 0)
#   s5e     (one GPU) session 5, call 5, version 9 (training multiplies in TF32x3): the training classes
#           up to K = 128, then the training bench at one shape
#   next6   (nvidia-h200-x2) for session 6, version 9 as shipped: the training classes up to K = 128 that
#           session 5 could not finish, then the rest of the grid (GPU 1); training benches with TF32x3
#           and the varlen forward bench (GPU 0)
#   s6a     (nvidia-h200-x2) session 6, call 1, version 9: the training classes up to K = 128 (GPU 1);
#           per-kernel profiles of FLA and triton, forward and training, and triton's stages (GPU 0)
#   s6b     (nvidia-h200-x2) session 6, call 2, version 10 (state and output on half-width tensor cores at
#           inference; training's output in TF32): the grid (GPU 1); stages, state/output sweep, training
#           sweep of the backward's settings and products (GPU 0)
#   s6c     (nvidia-h200-x2) session 6, call 3, version 11 (the backward's per-chunk kernel in two V passes,
#           its [C, K] tiles loaded late): the training classes (GPU 1); the training sweep, one variant a
#           process, with the PAIRS timing hook (GPU 0)
#   s6d     (nvidia-h200-x2) session 6, call 4, version 12 (the backward's diagonal blocks by products,
#           TF32 in intra and the backward state pass when training, output BV 128): the grid (GPU 1);
#           the bench's classes, then the forward bench with --tune, the training bench and the varlen
#           forward bench, then the training sweep and the stages (GPU 0)
#   s6e     (nvidia-h200-x2) session 6, call 5, version 12 as verified in call 4: the training bench at one
#           shape in both gate modes (GPU 0), the varlen forward bench at the H96 shapes (GPU 1)
#   s7a     (nvidia-h200-x2) for session 7, branch experiment/backward-diagonal-by-step, version 13 (the
#           backward's diagonal blocks by products wherever the log decays allow, the elementwise tails
#           fused): the grid (GPU 1); the bench classes, the training sweep, the training bench, the intra
#           kernel's phases (GPU 0)
#   s7b     (nvidia-h200-x2) session 7, call 2, version 14 (the backward's per-chunk kernel by blocks of K,
#           training offered at K = 256): the grid (GPU 1); the bench classes, the training sweep one
#           variant a process, the training bench at K = 128 and then at K = 256 (GPU 0)
#   s7c     (nvidia-h200-x2) session 7, call 3, version 15 (version 14 at 4 warps): the grid (GPU 1); the
#           bench classes, two training sweep variants, the training bench at K = 128 and 256 (GPU 0)
#   s7d     (nvidia-h200-x2) session 7, call 4, version 15: training at K = 256, triton's kernels (GPU 1) and
#           the training bench, FLA compiling its backward there first (GPU 0)
#   s7e     (one GPU, session 7's last 4 minutes) version 16 (training in TF32x3 in every kernel but the
#           output): the bench's training classes verified, then the training bench at K = 128
#   next8a  (nvidia-h200-x2) for session 8, version 16 as shipped: the grid, training at K = 256 included
#           (GPU 1); the bench classes, the training sweep at B4_T2048_H16_D128, the training bench with
#           --tune in both gate modes (GPU 0)
#   next8b  (nvidia-h200-x2) then: the training sweep at K = 256 over the serial passes' V columns (GPU 1);
#           the forward bench with --tune at the six dense shapes and the K = 256 training bench (GPU 0)
#   s8b     (nvidia-h200-x2) session 8, call 2: the TF32x3 training kernels' launch settings, swept at
#           B4_T2048_H16_D128 (GPU 0) and B8_T2048_H32_D256 (GPU 1)
#   next9a  (nvidia-h200-x2) for session 9, version 19: the grid, the K = 256 training bench beside FLA
#           and sweep (GPU 1); the bench classes, the training bench, the varlen forward bench, the
#           hardest random training cases through FLA and ours (GPU 0)
#   s9b     (nvidia-h200-x2) session 9, call 2, version 20 (training at K > 128: the backward state pass at 8
#           warps, intra's scores in K steps of 64): the grid, the K = 256 training bench and sweep, inference's
#           intra in K steps at K = 256 (GPU 1); the bench classes, the training bench at the six dense shapes,
#           training's intra in K steps at K = 128 (GPU 0)
#   s9c     (nvidia-h200-x2) session 9, call 3, version 20: the training bench at the three dense shapes call 2
#           did not reach (GPU 1); the training kernels at B1_T8192_H96_D128 and what TF32x3 costs there,
#           kernel by kernel (GPU 0)
#   s9d     (one GPU, session 9's last device minutes) version 20: the forward and training bench with --tune
#           at B8_T1024_H8_D64, where triton is the fastest, so that `auto` learns it and is seen to choose it
#   s8d     (nvidia-h200-x2) session 8, call 4: version 18's grid and bench classes, training kernels and
#           bench, the forward bench at the three dense shapes s8c did not reach
#   s8c     (nvidia-h200-x2) session 8, call 3: version 17's grid and bench classes, the training sweep and
#           bench, the forward bench at the dense shapes (both benches with --tune)
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
DENSE="B1_T8192_H96_D128 B2_T16384_H16_D128 B4_T2048_H16_D128 B4_T4096_H64_D128 B8_T2048_H32_D256 B8_T1024_H8_D64"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)';
  python3 -m pip list 2>/dev/null | grep -i -E "fla-core|flashkda|pydantic|rich|helion"; } > "$W/env.txt" 2>&1

finish() {
  cp -r /tmp/kda-cache/timings "$W/timings" 2>/dev/null  # auto's timing table as the phase left it
  (cd /tmp && find triton-cache -name '*.autotune.json' > /tmp/autotune.list; tar czf "$OUT/state.tgz" kda-cache -T /tmp/autotune.list)
  tar czf "$OUT/$PHASE.tgz" -C "$W" .
  ls -la "$OUT"
}

# Steps the phases from session 5 on share. RESERVE: seconds to leave before the deadline.
wrap_up() {  # [VERIFICATION LOGS]: wait for the background work; exit codes, the logs' tails, any failure
  wait
  cat "$W"/*.rc
  [ $# -eq 0 ] || tail -n 4 "$@"
  grep -E "FAIL|fail " "$W"/verify-*.txt | head -20
}
verify_triton() {  # RESERVE JOBS NAME [more kda.verify arguments]: logs, JSON and rc under $W/NAME*
  local reserve=$1 jobs=$2 name=$3; shift 3
  timeout "$(left "$reserve")" python3 -m kda.verify --backend triton --jobs "$jobs" "$@" \
    --work-dir "$W/$name-workers" --json "$W/$name.json" > "$W/$name.txt" 2> "$W/$name.err"
  echo "$name rc=$?" > "$W/$name.rc"
}
bench() {  # RESERVE NAME [kda.bench arguments]: results under $W/NAME, its rows echoed
  local reserve=$1 name=$2; shift 2
  timeout "$(left "$reserve")" python3 -m kda.bench "$@" --out "$W/$name" > "$W/$name.txt" 2> "$W/$name.err"
  echo "$name rc=$?"; grep -E " ok | fail|rror" "$W/$name.err" | head -20
}
bench_case_args() {  # the case classes of the bench's default shapes and modes
  for key in $(python3 -c "from kda.bench.shapes import DEFAULT_SHAPES, MODES, case_class_keys
print(' '.join(case_class_keys(DEFAULT_SHAPES, list(MODES))))"); do printf -- '--case %s ' "$key"; done
}
shape_args() { for shape in "$@"; do printf -- '--shape %s ' "$shape"; done; }
training_case_args() {  # every training class up to K = 128 (training above is refused on CUDA)
  for key in $(python3 -m kda.verify --list-cases | grep "/train" | grep -v d256); do printf -- '--case %s ' "$key"; done
}
train_sweep() {  # RESERVE SHAPE FILE INDEX...: TRAIN_SWEEP variants one a process, appended to $W/FILE
  local reserve=$1 shape=$2 file=$3; shift 3
  for index in "$@"; do
    SWEEP_INDEX=$index timeout "$(left "$reserve")" python3 benchmarks/triton_stages.py --train-sweep "$shape" \
      2>&1 | grep -v -i warn >> "$W/$file"
  done
}
stages() {  # RESERVE [triton_stages.py arguments]
  local reserve=$1; shift
  timeout "$(left "$reserve")" python3 benchmarks/triton_stages.py "$@" > "$W/$([ "$1" = --sweep ] && echo sweep || echo stages).txt" 2>&1
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
probe)
  # Session 3's first call: the triton backend's first GPU run (stage timings, first-call seconds), then
  # every backend verified over the grid (triton and the rest side by side, 8 processes each), then a
  # forward bench on the idle GPU with whatever time is left.
  export KDA_TRITON_EXPERIMENTAL=1
  timeout "$(left 420)" python3 benchmarks/triton_stages.py B1_T8192_H96_D128 B2_T16384_H16_D128 \
    B4_T2048_H16_D128 B8_T2048_H32_D256 B8_T1024_H8_D64 > "$W/stages.txt" 2>&1
  echo "stages rc=$?"; grep -E "total|first call" "$W/stages.txt" | head -40
  timeout "$(left 150)" python3 -m kda.verify --backend triton --with-bench-classes --jobs 8 \
    --work-dir "$W/verify-triton-workers" --json "$W/verify-triton.json" > "$W/verify-triton.txt" 2> "$W/verify-triton.err" &
  timeout "$(left 150)" python3 -m kda.verify --backend torch --backend fla --backend flashkda --with-bench-classes \
    --jobs 8 --work-dir "$W/verify-workers" --json "$W/verify-cuda.json" > "$W/verify-cuda.txt" 2> "$W/verify-cuda.err" &
  wait
  echo "verify done"; tail -n 3 "$W/verify-triton.txt" "$W/verify-cuda.txt"
  grep -h -E "FAIL" "$W/verify-triton.txt" "$W/verify-cuda.txt" | head -20
  timeout "$(left 15)" python3 -m kda.bench --backend baseline:fla --backend baseline:flashkda --backend triton \
    --backend fla --backend auto --mode fwd --out "$W/bench-fwd" > "$W/bench-fwd.txt" 2> "$W/bench-fwd.err"
  echo "bench rc=$?"; grep -E "triton:|auto:" "$W/bench-fwd.err" | head -30
  ;;
pair)
  # Two GPUs (nvidia-h200-x2): GPU 1 verifies (the triton backend over its grid and the bench classes,
  # then the other backends), CPU-heavy compiles included; GPU 0 times: the triton stages and a launch
  # config sweep, then the forward bench of every backend at every shape (--tune), then the training
  # bench at the shapes in TRAIN_SHAPES. Timing runs only on GPU 0, one process at a time.
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    timeout "$(left 40)" python3 -m kda.verify --backend triton --quick --with-bench-classes --jobs 12 \
      --work-dir "$W/verify-triton-workers" --json "$W/verify-triton.json" > "$W/verify-triton.txt" 2> "$W/verify-triton.err"
    echo "verify triton rc=$?" > "$W/verify-triton.rc"
    timeout "$(left 40)" python3 -m kda.verify --backend fla --backend flashkda --backend torch --quick \
      --with-bench-classes --jobs 12 --work-dir "$W/verify-workers" --json "$W/verify-cuda.json" \
      > "$W/verify-cuda.txt" 2> "$W/verify-cuda.err"
    echo "verify others rc=$?" > "$W/verify-cuda.rc" ) &
  export CUDA_VISIBLE_DEVICES=0
  timeout "$(left 450)" python3 benchmarks/triton_stages.py B1_T8192_H96_D128 B2_T16384_H16_D128 \
    B4_T2048_H16_D128 B8_T2048_H32_D256 B8_T1024_H8_D64 > "$W/stages.txt" 2>&1
  timeout "$(left 410)" python3 benchmarks/triton_stages.py --sweep B1_T8192_H96_D128 > "$W/sweep.txt" 2>&1
  grep -E "total" "$W/stages.txt"; cat "$W/sweep.txt"
  timeout "$(left 170)" python3 -m kda.bench --tune --backend baseline:fla --backend baseline:flashkda --backend triton \
    --backend fla --backend auto --mode fwd --out "$W/bench-fwd" > "$W/bench-fwd.txt" 2> "$W/bench-fwd.err"
  echo "bench fwd rc=$?"; grep -E "ok|fail|error" "$W/bench-fwd.err" | grep -v cold=None | head -70
  timeout "$(left 20)" python3 -m kda.bench --tune --backend baseline:fla --backend triton --backend fla --backend auto \
    --mode train_safe --mode train_pregated ${TRAIN_SHAPES:---shape B4_T2048_H16_D128 --shape B1_T8192_H96_D128} \
    --out "$W/bench-train" > "$W/bench-train.txt" 2> "$W/bench-train.err"
  echo "bench train rc=$?"; grep -E "ok|fail|error" "$W/bench-train.err" | head -30
  wait
  cat "$W"/verify-*.rc; tail -n 4 "$W/verify-triton.txt" "$W/verify-cuda.txt"
  ;;
last)
  # One GPU, nothing in parallel (compiles beside each other starved the 'pair' run): the triton stages and
  # the config sweep, then the forward bench of every backend at BENCH_SHAPES, then one training shape.
  export KDA_TRITON_EXPERIMENTAL=1
  timeout "$(left 340)" python3 benchmarks/triton_stages.py B1_T8192_H96_D128 B4_T2048_H16_D128 > "$W/stages.txt" 2>&1
  grep -E "total|first" "$W/stages.txt"
  timeout "$(left 290)" python3 benchmarks/triton_stages.py --sweep B1_T8192_H96_D128 > "$W/sweep.txt" 2>&1
  cat "$W/sweep.txt"
  timeout "$(left 100)" python3 -m kda.bench --tune --backend baseline:fla --backend baseline:flashkda --backend triton \
    --backend fla --backend auto --mode fwd ${BENCH_SHAPES:---shape B1_T8192_H96_D128 --shape B4_T2048_H16_D128 \
    --shape B8_T1024_H8_D64 --shape varlen_H64_D128_L8192} --out "$W/bench-fwd" > "$W/bench-fwd.txt" 2> "$W/bench-fwd.err"
  echo "bench fwd rc=$?"; grep -E " ok | fail|rror" "$W/bench-fwd.err" | head -40
  timeout "$(left 10)" python3 -m kda.bench --backend baseline:fla --backend triton --mode train_safe \
    --shape B4_T2048_H16_D128 --out "$W/bench-train" > "$W/bench-train.txt" 2> "$W/bench-train.err"
  echo "bench train rc=$?"; grep -E " ok | fail|rror" "$W/bench-train.err" | head -10
  ;;
next)
  # For the next session (nvidia-h200-x2), call 1 of 2. GPU 1 verifies triton over the whole grid,
  # training included (8 processes, not more: 12 compiling beside a timed GPU starved it), then fla and
  # flashkda. GPU 0 first lets FLA autotune its backward at the training shapes (one process per shape
  # and mode, side by side: their timings are thrown away, their autotune results kept in state.tgz for
  # call 2), then runs the forward bench at every shape (triton's cold start meets an empty Triton
  # cache: nothing compiled triton on this machine before), then the launch-setting sweep.
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    timeout "$(left 60)" python3 -m kda.verify --backend triton --with-bench-classes --jobs 8 \
      --work-dir "$W/verify-triton-workers" --json "$W/verify-triton.json" > "$W/verify-triton.txt" 2> "$W/verify-triton.err"
    echo "verify triton rc=$?" > "$W/verify-triton.rc"
    T=$(left 60); [ "$T" -gt 30 ] && timeout "$T" python3 -m kda.verify --backend fla --backend flashkda --with-bench-classes \
      --jobs 8 --work-dir "$W/verify-workers" --json "$W/verify-cuda.json" > "$W/verify-cuda.txt" 2> "$W/verify-cuda.err"
    echo "verify others rc=$?" > "$W/verify-cuda.rc" ) &
  export CUDA_VISIBLE_DEVICES=0
  warming=""
  for shape in ${TRAIN_SHAPES:-B4_T2048_H16_D128 B8_T1024_H8_D64}; do
    for mode in train_safe train_pregated; do
      timeout "$(left 360)" python3 -m kda.bench --backend baseline:fla --shape "$shape" --mode "$mode" --cold-start none \
        --warmup-ms 5 --rep-ms 20 --rounds 1 --out "$W/warm-$shape-$mode" > "$W/warm-$shape-$mode.txt" 2>&1 &
      warming="$warming $!"
    done
  done
  wait $warming
  echo "warm done"; grep -h " ok \| error" "$W"/warm-*.txt | head
  timeout "$(left 170)" python3 -m kda.bench --tune --backend baseline:fla --backend baseline:flashkda --backend triton \
    --backend fla --backend auto --mode fwd --out "$W/bench-fwd" > "$W/bench-fwd.txt" 2> "$W/bench-fwd.err"
  echo "bench fwd rc=$?"; grep -E " ok | fail|rror" "$W/bench-fwd.err" | head -70
  timeout "$(left 30)" python3 benchmarks/triton_stages.py --sweep B1_T8192_H96_D128 B4_T2048_H16_D128 > "$W/sweep.txt" 2>&1
  cat "$W/sweep.txt"
  wait
  cat "$W"/verify-*.rc; tail -n 4 "$W/verify-triton.txt" "$W/verify-cuda.txt"
  ;;
next-train)
  # Call 2 of 2 (copy call 1's state.tgz to .device/state.tgz first): the training bench, FLA reading the
  # autotune results call 1 left, triton opted in.
  export KDA_TRITON_EXPERIMENTAL=1
  SHAPES=""; for shape in ${TRAIN_SHAPES:-B4_T2048_H16_D128 B8_T1024_H8_D64}; do SHAPES="$SHAPES --shape $shape"; done
  timeout "$(left 20)" python3 -m kda.bench --tune --backend baseline:fla --backend triton --backend fla --backend auto \
    --mode train_safe --mode train_pregated $SHAPES --out "$W/bench-train" > "$W/bench-train.txt" 2> "$W/bench-train.err"
  echo "bench train rc=$?"; grep -E " ok | fail|rror" "$W/bench-train.err" | head -30
  ;;
s4)
  # Session 4, call 1 (nvidia-h200-x2): the forward with intermediates stored in the inputs' dtype.
  # GPU 1: triton verified over the whole grid, training included, then FLA's backward autotuned at the
  # training shapes for call 2 (timings thrown away, autotune results kept in state.tgz). GPU 0, one
  # process at a time: per-stage times, one Nsight Compute pass over the forward's four kernels, the
  # forward bench at every shape, then the launch-setting sweep.
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    timeout "$(left 200)" python3 -m kda.verify --backend triton --with-bench-classes --jobs 8 \
      --work-dir "$W/verify-triton-workers" --json "$W/verify-triton.json" > "$W/verify-triton.txt" 2> "$W/verify-triton.err"
    echo "verify triton rc=$?" > "$W/verify-triton.rc"
    for mode in train_safe train_pregated; do
      timeout "$(left 40)" python3 -m kda.bench --backend baseline:fla --shape "${TRAIN_SHAPE:-B4_T2048_H16_D128}" \
        --mode "$mode" --cold-start none --warmup-ms 5 --rep-ms 20 --rounds 1 --out "$W/warm-$mode" > "$W/warm-$mode.txt" 2>&1 &
    done
    wait ) &
  export CUDA_VISIBLE_DEVICES=0
  timeout "$(left 480)" python3 benchmarks/triton_stages.py B1_T8192_H96_D128 B4_T2048_H16_D128 B8_T1024_H8_D64 \
    > "$W/stages.txt" 2>&1
  grep -E "ms|first" "$W/stages.txt"
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout "$(left 400)" "$NCU" --clock-control none --kernel-name regex:'gate_cumsum|intra_chunk|state_pass|output_kernel' \
    --launch-count 4 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats \
    python3 benchmarks/triton_stages.py --once B1_T8192_H96_D128 > "$W/ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -E "^  [a-z_]+kernel|Duration|Memory Throughput|Achieved Occupancy|Registers Per|Block Limit|Compute \(SM\) Thr" "$W/ncu.txt" | head -60
  timeout "$(left 120)" python3 -m kda.bench --tune --backend baseline:fla --backend baseline:flashkda --backend triton \
    --backend fla --backend auto --mode fwd --out "$W/bench-fwd" > "$W/bench-fwd.txt" 2> "$W/bench-fwd.err"
  echo "bench fwd rc=$?"; grep -E " ok | fail|rror" "$W/bench-fwd.err" | head -70
  timeout "$(left 25)" python3 benchmarks/triton_stages.py --sweep B1_T8192_H96_D128 > "$W/sweep.txt" 2>&1
  cat "$W/sweep.txt"
  wait
  cat "$W"/verify-*.rc; tail -n 4 "$W/verify-triton.txt"; grep -h " ok \| error" "$W"/warm-*.txt | head
  ;;
s4b)
  # Session 4, call 2 (nvidia-h200-x2), after the product inverse and the sweep's settings. GPU 1: quick
  # verification of triton (training included), then the training bench at one shape. GPU 0: stages,
  # sweep, then the forward bench at the six dense shapes and two varlen ones.
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    timeout "$(left 280)" python3 -m kda.verify --backend triton --quick --with-bench-classes --jobs 8 \
      --work-dir "$W/verify-triton-workers" --json "$W/verify-triton.json" > "$W/verify-triton.txt" 2> "$W/verify-triton.err"
    echo "verify triton rc=$?" > "$W/verify-triton.rc"
    timeout "$(left 15)" python3 -m kda.bench --backend baseline:fla --backend triton --mode train_safe \
      --shape "${TRAIN_SHAPE:-B4_T2048_H16_D128}" --out "$W/bench-train" > "$W/bench-train.txt" 2> "$W/bench-train.err"
    echo "bench train rc=$?" > "$W/bench-train.rc" ) &
  export CUDA_VISIBLE_DEVICES=0
  timeout "$(left 480)" python3 benchmarks/triton_stages.py B1_T8192_H96_D128 B4_T2048_H16_D128 B8_T1024_H8_D64 \
    > "$W/stages.txt" 2>&1
  grep -E "ms|first" "$W/stages.txt"
  timeout "$(left 330)" python3 benchmarks/triton_stages.py --sweep B1_T8192_H96_D128 > "$W/sweep.txt" 2>&1
  cat "$W/sweep.txt"
  SHAPES=""; for shape in B1_T8192_H96_D128 B2_T16384_H16_D128 B4_T2048_H16_D128 B4_T4096_H64_D128 B8_T2048_H32_D256 \
    B8_T1024_H8_D64 varlen_H64_D128_L8192 varlen_H96_D128_L1024x8; do SHAPES="$SHAPES --shape $shape"; done
  timeout "$(left 15)" python3 -m kda.bench --tune --backend baseline:fla --backend baseline:flashkda --backend triton \
    --backend auto --mode fwd $SHAPES --out "$W/bench-fwd" > "$W/bench-fwd.txt" 2> "$W/bench-fwd.err"
  echo "bench fwd rc=$?"; grep -E " ok | fail|rror" "$W/bench-fwd.err" | head -50
  wait
  cat "$W"/*.rc; tail -n 4 "$W/verify-triton.txt"; grep -E " ok | fail|rror" "$W/bench-train.err" | head
  ;;
s5)
  # Session 5, call 1 (nvidia-h200-x2), run from the experiment branch. GPU 1: the triton forward over the
  # grid's forward classes and the bench classes. GPU 0: stages at two shapes, the sweep at B1, then the
  # forward and pre-gated forward benches at the six dense shapes beside FLA.
  ( export CUDA_VISIBLE_DEVICES=1; verify_triton 20 10 verify-triton --with-bench-classes ) &
  export CUDA_VISIBLE_DEVICES=0
  stages 470 B1_T8192_H96_D128 B8_T2048_H32_D256; cat "$W/stages.txt"
  stages 330 --sweep B1_T8192_H96_D128; cat "$W/sweep.txt"
  bench 130 bench-fwd --backend baseline:fla --backend triton --mode fwd $(shape_args $DENSE)
  bench 25 bench-fwd-pregated --backend baseline:fla --backend triton --mode fwd_pregated $(shape_args $DENSE)
  wait
  cat "$W"/*.rc; tail -n 8 "$W/verify-triton.txt"; grep -i -E "fail|error" "$W/verify-triton.txt" | head -20
  ;;
s5b)
  # Session 5, call 2 (nvidia-h200-x2), version 6. GPU 1: the whole grid, training included (12 processes).
  # GPU 0: stages at B1 (the gate's 16-row scans), the sweep (with the intra_block_k variants never timed),
  # the forward and pre-gated forward benches at the six dense shapes, then training at one shape.
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1; verify_triton 20 12 verify-triton --with-bench-classes ) &
  export CUDA_VISIBLE_DEVICES=0
  stages 480 B1_T8192_H96_D128; cat "$W/stages.txt"
  stages 360 --sweep B1_T8192_H96_D128; cat "$W/sweep.txt"
  bench 200 bench-fwd --backend baseline:fla --backend triton --mode fwd $(shape_args $DENSE)
  bench 110 bench-fwd-pregated --backend baseline:fla --backend triton --mode fwd_pregated $(shape_args $DENSE)
  bench 25 bench-train --backend baseline:fla --backend triton --mode train_safe --mode train_pregated \
    --shape B4_T2048_H16_D128
  wrap_up "$W/verify-triton.txt"
  ;;
s5c)
  # Session 5, call 3 (nvidia-h200-x2), version 7: the intra kernel at 2 warps (K <= 128, from call 2's
  # sweep). GPU 1: the grid, training included. GPU 0: stages at B1 and D256, the intra warps at D256,
  # then the forward bench with auto at the six dense shapes.
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1; verify_triton 20 12 verify-triton --with-bench-classes ) &
  export CUDA_VISIBLE_DEVICES=0
  stages 420 B1_T8192_H96_D128 B8_T2048_H32_D256; cat "$W/stages.txt"
  SWEEP_ONLY=intra_warps stages 330 --sweep B8_T2048_H32_D256; cat "$W/sweep.txt"
  bench 25 bench-fwd --backend baseline:fla --backend triton --backend auto --mode fwd $(shape_args $DENSE)
  wrap_up "$W/verify-triton.txt"
  ;;
s5d)
  # Session 5, call 4 (nvidia-h200-x2), version 8. GPU 1: the grid, training included. GPU 0: the forward
  # bench with --tune at the six dense shapes (auto's timing table for version 8).
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1; verify_triton 15 12 verify-triton --with-bench-classes ) &
  export CUDA_VISIBLE_DEVICES=0
  sleep 200  # auto trusts only verified backends: let GPU 1 verify the bench classes first
  bench 15 bench-fwd --tune --backend baseline:fla --backend triton --backend auto --mode fwd $(shape_args $DENSE)
  wrap_up "$W/verify-triton.txt"
  ;;
s5e)
  # Session 5, call 5 (one GPU, about 4 minutes of device time left), version 9: training's products in
  # TF32x3 (version 8 failed two bf16 training classes on dA_log with TF32). The 23 training classes up
  # to K = 128 (8 processes), then the training bench at B4_T2048_H16_D128.
  export KDA_TRITON_EXPERIMENTAL=1
  verify_triton 60 8 verify-triton $(training_case_args)
  cat "$W/verify-triton.rc"; tail -n 3 "$W/verify-triton.txt"; grep -E "FAIL|fail " "$W/verify-triton.txt" | head -10
  bench 5 bench-train --backend baseline:fla --backend triton --mode train_safe --shape B4_T2048_H16_D128 --rounds 1
  ;;
s6a)
  # Session 6, call 1 (nvidia-h200-x2), version 9. GPU 1: the training classes up to K = 128 that session 5
  # left unfinished. GPU 0: where the time goes, kernel by kernel, for FLA and for triton (unverified rows
  # run with KDA_VERIFY=off: this is a profile, not a result), then triton's forward stages.
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 20 12 verify-train $(training_case_args) ) &
  export CUDA_VISIBLE_DEVICES=0
  KDA_VERIFY=off timeout "$(left 200)" python3 benchmarks/profile_kernels.py --backend baseline:fla --backend triton \
    --mode fwd B1_T8192_H96_D128 B8_T2048_H32_D256 B4_T2048_H16_D128 > "$W/profile-fwd.txt" 2>&1
  KDA_VERIFY=off timeout "$(left 90)" python3 benchmarks/profile_kernels.py --backend baseline:fla --backend triton \
    --mode train_safe B4_T2048_H16_D128 > "$W/profile-train.txt" 2>&1
  stages 30 B1_T8192_H96_D128
  wrap_up "$W/verify-train.txt"
  grep -E " ms|us " "$W"/profile-*.txt | head -120; cat "$W/stages.txt"
  ;;
s6b)
  # Session 6, call 2 (nvidia-h200-x2), version 10. GPU 1: the whole grid with the bench classes. GPU 0:
  # forward stages, the state/output variants, then training kernel by kernel under the backward variants.
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 20 12 verify-triton --with-bench-classes ) &
  export CUDA_VISIBLE_DEVICES=0
  stages 300 B1_T8192_H96_D128
  SWEEP_ONLY="state|output|half" stages 200 --sweep B1_T8192_H96_D128
  timeout "$(left 30)" python3 benchmarks/triton_stages.py --train-sweep B4_T2048_H16_D128 > "$W/train-sweep.txt" 2>&1
  wrap_up "$W/verify-triton.txt"
  cat "$W/stages.txt" "$W/sweep.txt" "$W/train-sweep.txt"
  ;;
s6c)
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 20 12 verify-train $(training_case_args) ) &
  export CUDA_VISIBLE_DEVICES=0
  train_sweep 30 B4_T2048_H16_D128 train-sweep.txt $(seq 0 10)
  wrap_up "$W/verify-train.txt"
  cat "$W/train-sweep.txt"
  ;;
s6d)
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 20 12 verify-grid ) &
  export CUDA_VISIBLE_DEVICES=0
  verify_triton 330 10 verify-bench $(bench_case_args)
  bench 200 bench-fwd --tune --backend baseline:fla --backend triton --backend auto --mode fwd --mode fwd_pregated \
    $(shape_args $DENSE)
  bench 110 bench-train --tune --backend baseline:fla --backend triton --backend auto --mode train_safe \
    --mode train_pregated $(shape_args B4_T2048_H16_D128 B1_T8192_H96_D128)
  bench 60 bench-fwd-varlen --tune --backend baseline:fla --backend triton --backend auto --mode fwd \
    $(shape_args $(python3 -c "from kda.bench.shapes import VARLEN_SHAPES; print(' '.join(VARLEN_SHAPES))"))
  train_sweep 30 B4_T2048_H16_D128 train-sweep.txt 0
  stages 15 B1_T8192_H96_D128 B8_T2048_H32_D256
  wrap_up "$W/verify-grid.txt" "$W/verify-bench.txt"
  cat "$W/train-sweep.txt" "$W/stages.txt"
  ;;
s6e)
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    bench 10 bench-fwd-varlen --tune --backend baseline:fla --backend fla --backend triton --backend auto --mode fwd \
      $(shape_args varlen_H96_D128_L8192 varlen_H96_D128_L1300-547-2048-963-271-3063 varlen_H96_D128_L1024x8) ) &
  export CUDA_VISIBLE_DEVICES=0
  bench 10 bench-train --tune --backend baseline:fla --backend fla --backend triton --backend auto \
    --mode train_safe --mode train_pregated $(shape_args B4_T2048_H16_D128)
  wait
  cat "$W"/bench-*/results.md 2>/dev/null | grep "^|"
  ;;
s7a)
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 20 12 verify-grid ) &
  export CUDA_VISIBLE_DEVICES=0
  verify_triton 400 10 verify-bench $(bench_case_args)
  train_sweep 300 B4_T2048_H16_D128 train-sweep.txt 0 1 2
  bench 80 bench-train --tune --backend baseline:fla --backend fla --backend triton --backend auto \
    --mode train_safe --mode train_pregated $(shape_args B4_T2048_H16_D128)
  SWEEP_ONLY="intra_phases" stages 15 --sweep B1_T8192_H96_D128  # where the intra kernel's time goes
  wrap_up "$W/verify-grid.txt" "$W/verify-bench.txt"
  cat "$W/train-sweep.txt" "$W/sweep.txt"; cat "$W"/bench-train/results.md 2>/dev/null | grep "^|"
  ;;
s7b)
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 20 12 verify-grid ) &
  export CUDA_VISIBLE_DEVICES=0
  verify_triton 420 10 verify-bench $(bench_case_args)
  train_sweep 200 B4_T2048_H16_D128 train-sweep.txt 0 1 2 3 4 5 6 8
  bench 110 bench-train --tune --backend baseline:fla --backend fla --backend triton --backend auto \
    --mode train_safe --mode train_pregated $(shape_args B4_T2048_H16_D128)
  bench 25 bench-train-d256 --tune --backend baseline:fla --backend triton --backend auto \
    --mode train_safe --mode train_pregated $(shape_args B8_T2048_H32_D256)
  wrap_up "$W/verify-grid.txt" "$W/verify-bench.txt"
  cat "$W/train-sweep.txt"; cat "$W"/bench-train*/results.md 2>/dev/null | grep "^|"
  ;;
s7c)
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 15 12 verify-grid ) &
  export CUDA_VISIBLE_DEVICES=0
  verify_triton 380 10 verify-bench $(bench_case_args)
  train_sweep 250 B4_T2048_H16_D128 train-sweep.txt 0 1 2
  bench 150 bench-train --tune --backend baseline:fla --backend fla --backend triton --backend auto \
    --mode train_safe --mode train_pregated $(shape_args B4_T2048_H16_D128)
  bench 20 bench-train-d256 --tune --backend baseline:fla --backend triton --backend auto \
    --mode train_safe --mode train_pregated $(shape_args B8_T2048_H32_D256)
  wrap_up "$W/verify-grid.txt" "$W/verify-bench.txt"
  cat "$W/train-sweep.txt"; cat "$W"/bench-train*/results.md 2>/dev/null | grep "^|"
  ;;
s7d)
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    train_sweep 20 B8_T2048_H32_D256 train-sweep.txt 0 ) &
  export CUDA_VISIBLE_DEVICES=0
  bench 15 bench-train-d256 --tune --backend baseline:fla --backend triton --backend auto \
    --mode train_safe $(shape_args B8_T2048_H32_D256)
  wait
  cat "$W/train-sweep.txt"; cat "$W"/bench-train*/results.md 2>/dev/null | grep "^|"
  ;;
s7e)
  export KDA_TRITON_EXPERIMENTAL=1
  verify_triton 70 8 verify-train $(bench_case_args | tr ' ' '\n' | grep "/train" | grep -v d256 | sed 's/^/--case /')
  cat "$W/verify-train.rc"; tail -n 3 "$W/verify-train.txt"
  bench 5 bench-train --backend baseline:fla --backend triton --mode train_safe --mode train_pregated \
    $(shape_args B4_T2048_H16_D128) --rounds 2
  cat "$W"/bench-train/results.md 2>/dev/null | grep "^|"
  ;;
next9a)
  # For session 9 (nvidia-h200-x2), version 19 (version 18 with the backward state pass back in TF32x3),
  # which has not run on the H200. GPU 1: the whole grid, then the K = 256 training bench with FLA in the
  # same process (FLA's first call there takes about 80 s) and the K = 256 training sweep (that pass at 8
  # warps; training's intra settings). GPU 0: the bench classes, the training bench in both gate modes, the
  # varlen forward bench, the hardest random training cases through FLA and ours.
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 300 12 verify-grid
    bench 90 bench-train-d256 --tune --backend baseline:fla --backend triton --backend auto --mode train_safe \
      $(shape_args B8_T2048_H32_D256)
    train_sweep 10 B8_T2048_H32_D256 train-sweep-d256.txt 0 9 31 32 33 ) &
  export CUDA_VISIBLE_DEVICES=0
  verify_triton 420 10 verify-bench $(bench_case_args)
  bench 250 bench-train --tune --backend baseline:fla --backend fla --backend triton --backend auto \
    --mode train_pregated --mode train_safe $(shape_args B4_T2048_H16_D128)
  bench 80 bench-fwd-varlen --tune --backend baseline:fla --backend fla --backend triton --backend auto --mode fwd \
    $(shape_args $(python3 -c "from kda.bench.shapes import VARLEN_SHAPES; print(' '.join(VARLEN_SHAPES))"))
  # the four hardest random half-precision training cases of session 8, through FLA and ours on the GPU
  timeout "$(left 10)" python3 benchmarks/training_precision.py 12 56 --only 14,25,31,55 --gpu \
    --backend triton --backend fla > "$W/hard-cases.txt" 2>&1
  wrap_up "$W/verify-grid.txt" "$W/verify-bench.txt"
  cat "$W/hard-cases.txt"
  cat "$W/train-sweep-d256.txt"; cat "$W"/bench-*/results.md 2>/dev/null | grep "^|"
  ;;
s9b)
  # Session 9, call 2 (nvidia-h200-x2), version 20: version 19 (verified in call 1) with, above K = 128, the
  # backward state pass at 8 warps and training's intra summing its scores in K steps of 64 (call 1's
  # K = 256 sweep: 20.9 ms against 66.9, 6.1 against 15.6). GPU 1: the grid, the K = 256 training bench with
  # FLA, the K = 256 training sweep (one whole K step for comparison), inference's intra in K steps there.
  # GPU 0: the bench classes, the training bench at B4_T2048_H16_D128 (train_safe; call 1 reached only
  # train_pregated) and at the other dense shapes beside FLA, training's intra in K steps at K = 128.
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 300 12 verify-grid
    bench 120 bench-train-d256 --tune --backend baseline:fla --backend triton --backend auto --mode train_safe \
      $(shape_args B8_T2048_H32_D256)
    train_sweep 60 B8_T2048_H32_D256 train-sweep-d256.txt 0 34
    SWEEP_ONLY="'intra_block_k': 64" stages 10 --sweep B8_T2048_H32_D256 ) &
  export CUDA_VISIBLE_DEVICES=0
  verify_triton 420 10 verify-bench $(bench_case_args)
  bench 300 bench-train --tune --backend baseline:fla --backend triton --backend auto --mode train_safe \
    $(shape_args B4_T2048_H16_D128)
  train_sweep 220 B4_T2048_H16_D128 train-sweep.txt 0 35 36
  bench 10 bench-train-dense --cold-start none --backend baseline:fla --backend triton --mode train_safe \
    $(shape_args B1_T8192_H96_D128 B4_T4096_H64_D128 B2_T16384_H16_D128 B8_T1024_H8_D64)
  wrap_up "$W/verify-grid.txt" "$W/verify-bench.txt"
  cat "$W/train-sweep.txt" "$W/train-sweep-d256.txt" "$W/sweep.txt"; cat "$W"/bench-*/results.md 2>/dev/null | grep "^|"
  ;;
s9c)
  # Session 9, call 3 (nvidia-h200-x2), version 20 as verified in call 2 (same warm machine: its records).
  ( export CUDA_VISIBLE_DEVICES=1
    bench 10 bench-train-dense --cold-start none --backend baseline:fla --backend triton --mode train_safe \
      $(shape_args B8_T1024_H8_D64 B4_T4096_H64_D128 B2_T16384_H16_D128) ) &
  export CUDA_VISIBLE_DEVICES=0
  train_sweep 10 B1_T8192_H96_D128 train-sweep-b1.txt 0 13 12 11 8
  wrap_up
  cat "$W/train-sweep-b1.txt"; cat "$W"/bench-*/results.md 2>/dev/null | grep "^|"
  ;;
s9d)
  # Session 9, call 4 (one GPU), version 20 (its verification records come in state.tgz from call 3).
  bench 5 bench-auto --tune --backend baseline:fla --backend fla --backend triton --backend auto \
    --mode fwd --mode train_safe $(shape_args B8_T1024_H8_D64)
  cat "$W"/bench-*/results.md 2>/dev/null | grep "^|"
  ;;
s8d)
  # Session 8, call 4 (nvidia-h200-x2), version 18 (version 17 with the backward state pass at 8 warps, and
  # at 32 V columns for K > 128). GPU 1: the grid, then the K = 256 training kernels (and that pass at 8
  # warps there). GPU 0: the bench classes, the training kernels and bench (--tune), then the forward bench
  # (--tune) at the dense shapes call 3 did not reach.
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 150 12 verify-grid
    train_sweep 10 B8_T2048_H32_D256 train-sweep-d256.txt 0 9 ) &
  export CUDA_VISIBLE_DEVICES=0
  verify_triton 350 10 verify-bench $(bench_case_args)
  train_sweep 320 B4_T2048_H16_D128 train-sweep.txt 0
  bench 230 bench-train --tune --backend baseline:fla --backend fla --backend triton --backend auto \
    --mode train_safe --mode train_pregated $(shape_args B4_T2048_H16_D128)
  bench 10 bench-fwd --tune --backend baseline:fla --backend fla --backend triton --backend auto --mode fwd \
    --mode fwd_pregated $(shape_args B8_T1024_H8_D64 B4_T4096_H64_D128 B8_T2048_H32_D256)
  wrap_up "$W/verify-grid.txt" "$W/verify-bench.txt"
  cat "$W/train-sweep.txt" "$W/train-sweep-d256.txt"; cat "$W"/bench-*/results.md 2>/dev/null | grep "^|"
  ;;
s8c)
  # Session 8, call 3 (nvidia-h200-x2), version 17 (the backward state pass in rounded TF32, at 64 V columns
  # for K > 128 too; training's intra by 16 columns of w/u; dv in v's dtype; training on CUDA by default).
  # GPU 1: the grid, then the K = 256 training kernels. GPU 0: the bench classes, the training sweep
  # (version 16's products in the same process; launch variants), the training bench and the forward
  # bench at the dense shapes, both with --tune (auto's timing table).
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 90 12 verify-grid
    train_sweep 15 B8_T2048_H32_D256 train-sweep-d256.txt 0 16 ) &
  export CUDA_VISIBLE_DEVICES=0
  verify_triton 400 10 verify-bench $(bench_case_args)
  train_sweep 300 B4_T2048_H16_D128 train-sweep.txt 0 29 30 9 10 18 27 28
  bench 200 bench-train --tune --backend baseline:fla --backend fla --backend triton --backend auto \
    --mode train_safe --mode train_pregated $(shape_args B4_T2048_H16_D128)
  bench 10 bench-fwd --tune --backend baseline:fla --backend fla --backend triton --backend auto --mode fwd \
    --mode fwd_pregated $(shape_args $DENSE)
  wrap_up "$W/verify-grid.txt" "$W/verify-bench.txt"
  cat "$W/train-sweep.txt" "$W/train-sweep-d256.txt"; cat "$W"/bench-*/results.md 2>/dev/null | grep "^|"
  ;;
s8b)
  # Session 8, call 2 (nvidia-h200-x2), version 16: the launch settings of the TF32x3 training kernels.
  # GPU 0: the training sweep at B4_T2048_H16_D128 (backward state pass, intra, state pass variants);
  # GPU 1: at B8_T2048_H32_D256 (the serial passes' V columns, intra at 4 warps).
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    train_sweep 15 B8_T2048_H32_D256 train-sweep-d256.txt 0 14 15 16 17 18 ) &
  export CUDA_VISIBLE_DEVICES=0
  train_sweep 15 B4_T2048_H16_D128 train-sweep.txt 0 18 23 24 9 10 19 20 21 22 25 26
  wait
  cat "$W/train-sweep.txt" "$W/train-sweep-d256.txt"
  ;;
next8a)
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 15 12 verify-grid ) &
  export CUDA_VISIBLE_DEVICES=0
  verify_triton 400 10 verify-bench $(bench_case_args)
  train_sweep 250 B4_T2048_H16_D128 train-sweep.txt 0 1 2
  bench 20 bench-train --tune --backend baseline:fla --backend fla --backend triton --backend auto \
    --mode train_safe --mode train_pregated $(shape_args B4_T2048_H16_D128)
  wrap_up "$W/verify-grid.txt" "$W/verify-bench.txt"
  cat "$W/train-sweep.txt"; cat "$W"/bench-train*/results.md 2>/dev/null | grep "^|"
  ;;
next8b)
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    train_sweep 20 B8_T2048_H32_D256 train-sweep-d256.txt 0 14 15 16 17 ) &
  export CUDA_VISIBLE_DEVICES=0
  bench 200 bench-fwd --tune --backend baseline:fla --backend fla --backend triton --backend auto --mode fwd \
    --mode fwd_pregated $(shape_args $DENSE)
  bench 15 bench-train-d256 --tune --backend baseline:fla --backend triton --backend auto --mode train_safe \
    $(shape_args B8_T2048_H32_D256)
  wait
  cat "$W/train-sweep-d256.txt"; cat "$W"/bench-*/results.md 2>/dev/null | grep "^|"
  ;;
next6)
  # For session 6 (nvidia-h200-x2), version 9. GPU 1: the training classes up to K = 128 first (session 5's
  # call 5 finished 14 of 23 before its deadline), then the whole grid. GPU 0: training at two shapes in
  # both gate modes (TF32x3 products, never timed), then the varlen forward bench (last measured with
  # version 3).
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    verify_triton 200 12 verify-train $(training_case_args)
    verify_triton 20 12 verify-triton --with-bench-classes ) &
  export CUDA_VISIBLE_DEVICES=0
  sleep 150  # auto and the bench trust only verified backends: the training classes first
  bench 200 bench-train --backend baseline:fla --backend triton --mode train_safe --mode train_pregated \
    $(shape_args B4_T2048_H16_D128 B1_T8192_H96_D128)
  bench 25 bench-fwd-varlen --tune --backend baseline:fla --backend triton --backend auto --mode fwd \
    $(shape_args $(python3 -c "from kda.bench.shapes import VARLEN_SHAPES; print(' '.join(VARLEN_SHAPES))"))
  wrap_up "$W/verify-train.txt" "$W/verify-triton.txt"
  ;;
s4c)
  # Session 4, call 3 (one GPU): the K = 256 settings (stages, sweep at B8_T2048_H32_D256), then the
  # forward bench at every shape with the final settings (FLA re-measured in the same process).
  export KDA_TRITON_EXPERIMENTAL=1
  timeout "$(left 420)" python3 benchmarks/triton_stages.py B8_T2048_H32_D256 B1_T8192_H96_D128 > "$W/stages.txt" 2>&1
  grep -E "ms|first" "$W/stages.txt"
  timeout "$(left 300)" python3 benchmarks/triton_stages.py --sweep B8_T2048_H32_D256 > "$W/sweep.txt" 2>&1
  cat "$W/sweep.txt"
  timeout "$(left 15)" python3 -m kda.bench --tune --backend baseline:fla --backend triton --backend auto --mode fwd \
    --out "$W/bench-fwd" > "$W/bench-fwd.txt" 2> "$W/bench-fwd.err"
  echo "bench fwd rc=$?"; grep -E " ok | fail|rror" "$W/bench-fwd.err" | head -50
  ;;
s4d)
  # Session 4, call 4 (one GPU, the last minutes): the final kernels (backend version 3) verified on the
  # bench's case classes, forward and training at d128, three cases each.
  export KDA_TRITON_EXPERIMENTAL=1
  CASES=""; for key in safe/l2/sig/bf16/dense/mha/h0+ht/c64/d128/fwd safe/l2/sig/bf16/varlen/mha/h0+ht/c64/d128/fwd \
    safe/l2/sig/bf16/dense/mha/h0+ht/c64/d64/fwd safe/l2/sig/bf16/dense/mha/h0+ht/c64/d256/fwd \
    safe/l2/sig/bf16/dense/mha/nostate/c64/d128/train pregated/l2/sig/bf16/dense/mha/nostate/c64/d128/train; do
    CASES="$CASES --case $key"; done
  timeout "$(left 10)" python3 -m kda.verify --backend triton $CASES --jobs 6 --work-dir "$W/verify-triton-workers" \
    --json "$W/verify-triton.json" > "$W/verify-triton.txt" 2> "$W/verify-triton.err"
  echo "verify triton rc=$?"; cat "$W/verify-triton.txt" | tail -20; cat "$W"/verify-triton-workers/*.log | head -30
  ;;
next5)
  # For session 5 (nvidia-h200-x2), call 1. GPU 1: triton over the whole grid, training included (12
  # processes on 32 CPUs; the logs give each class's seconds; the records persist in state.tgz, so a
  # second call with the same phase goes on where this one stopped only if the verifier skips recorded
  # classes: it does not yet, so narrow it with --case then). GPU 0: stages and the sweep (with the
  # untried intra_block_k variants), then the pre-gated forward bench at the dense shapes, then the
  # training bench at one shape in both gate modes.
  export KDA_TRITON_EXPERIMENTAL=1
  ( export CUDA_VISIBLE_DEVICES=1
    # Where a class's 12-57 s per case go (session 4: even a case with no new compile took 12-33 s).
    timeout 150 python3 -m cProfile -s cumtime -m kda.verify --backend triton \
      --case safe/l2/sig/bf16/dense/mha/h0+ht/c64/d128/fwd > "$W/verify-profile.txt" 2>&1
    timeout "$(left 30)" python3 -m kda.verify --backend triton --with-bench-classes --jobs 12 \
      --work-dir "$W/verify-triton-workers" --json "$W/verify-triton.json" > "$W/verify-triton.txt" 2> "$W/verify-triton.err"
    echo "verify triton rc=$?" > "$W/verify-triton.rc" ) &
  export CUDA_VISIBLE_DEVICES=0
  timeout "$(left 480)" python3 benchmarks/triton_stages.py B1_T8192_H96_D128 > "$W/stages.txt" 2>&1
  timeout "$(left 360)" python3 benchmarks/triton_stages.py --sweep B1_T8192_H96_D128 > "$W/sweep.txt" 2>&1
  cat "$W/stages.txt" "$W/sweep.txt"
  SHAPES=""; for shape in B1_T8192_H96_D128 B2_T16384_H16_D128 B4_T2048_H16_D128 B4_T4096_H64_D128 B8_T2048_H32_D256 \
    B8_T1024_H8_D64; do SHAPES="$SHAPES --shape $shape"; done
  timeout "$(left 200)" python3 -m kda.bench --backend baseline:fla --backend triton --mode fwd_pregated $SHAPES \
    --out "$W/bench-fwd-pregated" > "$W/bench-fwd-pregated.txt" 2> "$W/bench-fwd-pregated.err"
  echo "bench fwd_pregated rc=$?"; grep -E " ok | fail|rror" "$W/bench-fwd-pregated.err" | head -20
  timeout "$(left 40)" python3 -m kda.bench --backend baseline:fla --backend triton --mode train_safe \
    --mode train_pregated --shape "${TRAIN_SHAPE:-B1_T8192_H96_D128}" --out "$W/bench-train" > "$W/bench-train.txt" 2> "$W/bench-train.err"
  echo "bench train rc=$?"; grep -E " ok | fail|rror" "$W/bench-train.err" | head
  wait
  cat "$W"/*.rc; tail -n 4 "$W/verify-triton.txt"
  ;;
*) echo "unknown phase $PHASE"; exit 2 ;;
esac
finish
