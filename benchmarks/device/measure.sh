#!/usr/bin/env bash
# Measure kda on a lent GPU machine, from the repository root (device tool: carry [".device"]):
#
#   bash benchmarks/device/measure.sh TARGET [TARGET ...]
#
# Targets (each writes $OUT/<target>/ and the machine's versions to $OUT/env.txt, packed at the end):
#   verify       python -m kda.verify --all --with-bench-classes over VERIFY_JOBS processes -> verify.json
#                (VERIFY_BACKENDS narrows it to those backends, VERIFY_CASES_FILE to the case-class keys in
#                that file; VERIFY_NAME names the output folder, default verify; at most VERIFY_S seconds of
#                the deadline when set; VERIFY_MISSING=1 verifies only what the records kept in state.tgz
#                lack, so a later run continues what a deadline cut); the workers' part-N.json and logs come back
#                as <name>/workers.tgz, so a cut run keeps its classes
#   bench        the inference bench (MODES, default fwd) at SHAPES (default: the six dense shapes), FLA and
#                FlashKDA called directly beside kda's backends and auto, with --tune (BENCH_BACKENDS narrows
#                the backends, e.g. "baseline:fla baseline:flashkda tilelang"; a shape takes minutes with all)
#   train-bench  the training bench (train_safe) at SHAPES, FLA beside kda's training backends and auto, with
#                --tune (TRAIN_BACKENDS narrows the backends); FLA twice: on its Triton kernels (baseline:fla,
#                the ratios' reference) and as installed (baseline:fla-tilelang: its TileLang backward stage)
#   decode       the decode op (`--mode decode`) at DECODE_SHAPES (default: its 12 shapes), FLA's
#                fused_recurrent_kda_fwd beside kda's backends and auto, against the copy bandwidth, with --tune
#   decode-tune  benchmarks/decode_sweep.py: the decode kernel's launch candidates timed per state dtype, the
#                winners verified over the decode classes and benchmarked (eager and CUDA-graph replays, FLA
#                beside them), and an eager call's host time at N = 1 -> sweep.json, verify.json, decode.json,
#                host.txt (the winners then go into configs.py's _DECODE_TABLE by hand)
#   graphs       the GPU tests of CUDA-graph capture and replay (chunk_kda and the decode step) and of
#                torch.compile: pytest -m gpu over tests/test_compile.py and tests/recurrent
#   sweep        benchmarks/triton_stages.py: the forward's stages and launch variants at SWEEP_SHAPE, then
#                the training kernels' variants (--train-sweep, one variant a process)
#   profile      benchmarks/profile_kernels.py: per-kernel times (torch's profiler: every GPU kernel of a call,
#                torch's own included) of PROFILE_BACKENDS (default "baseline:fla triton") at SWEEP_SHAPE
#   helion-stages benchmarks/helion_stages.py: the helion backend's time per kernel (in the call, and alone) at STAGE_SHAPES (default
#                B4_T2048_H16_D128) in MODES (default fwd fwd_pregated train_safe), one process a mode; then
#                the cases of the d256 training class that faulted (HELION_FAULT_CASE; empty skips it) with a
#                synchronize after each launch, which names a faulting kernel
#   helion-decode benchmarks/helion_decode.py: a Helion decode step (T = 1) against the triton backend's and
#                FLA's, CUDA-graph replays, at HELION_DECODE_SHAPES (default its six) over its configurations
#   helion-compile the helion backend's first call in a fresh process (kda.bench.cold, verification off) at
#                HELION_COMPILE_SHAPE (default B1_T8192_H96_D128) in HELION_COMPILE_MODES (default fwd train_safe): with
#                nothing compiled on disk, then with Triton's cache and kda's code cache (code_cache.py) warm, then
#                with Triton's cache alone (KDA_HELION_CODE_CACHE=0) -> times.txt
#   helion-halves benchmarks/helion_halves.py: the training serial passes (state, state_backward) in three
#                forms: fp32 operands in TF32x3, the backend's on bf16 halves, and variants reading every
#                operand as stored halves; then chunk_backward's two forms (TF32x3, and halves at five
#                launch settings) on a training call's own arguments; results compared then timed
#                interleaved, at HALVES_SHAPES (default B4_T2048_H16_D128 B1_T8192_H96_D128)
#   cp-scaling   benchmarks/cp_scaling.py under torchrun on 1, 2, 4 and 8 GPUs (as many as this machine has): the
#                equality check of both context-parallel modes against the one-GPU call at W > 1, then a
#                training step's time per mode for each CP_SETS entry ("tokens,tokens:heads ...", default
#                "32768,131072,262144:32 131072:96") and CP_BACKENDS (default triton) -> times.jsonl, report.txt
#   tests        the test suite on CUDA (its GPU-only tests run there); TESTS narrows it (pytest paths and
#                options, e.g. "-m gpu tests/backends/tilelang"); TEST_GROUPS ("args; args; ...") runs one
#                pytest process a group, side by side -> tests/pytest-N.txt
#   tilelang-compile  benchmarks/tilelang_compile.py: the tilelang backend's cold compile per head size, a first
#                call at a new shape once compiled, and a new process on TileLang's disk cache -> times.jsonl,
#                for each of TILELANG_COMPILE_MODES (default fwd; train_safe compiles the backward's five too)
#                (the tilelang backend needs TileLang carried: `prepare.sh all`, or `prepare.sh tilelang` too;
#                its compiled kernels are not kept in state.tgz: with them it passed the 16 MiB a file comes back at)
#   tilelang-stages  benchmarks/tilelang_stages.py: the tilelang backend's time and bytes per kernel at
#                STAGE_SHAPES (default B1_T8192_H96_D128 B4_T2048_H16_D128) in STAGE_MODES (default fwd
#                fwd_pregated; train_safe and train_pregated time the backward's kernels too); with
#                VARIANTS ("kernel:name=path ...": changed copies of a kernel's module, e.g. under .device/) each
#                variant's kernel is timed in the same process, interleaved with the shipped one; with PLANS
#                ("split fused:64 ...") the forward's serial pass planned each way, the same way
#   tilelang-ncu Nsight Compute (--set full) on NCU_LAUNCHES (default 1) launches of the tilelang kernels matching
#                NCU_KERNELS (default intra) at NCU_SHAPE (default B1_T8192_H96_D128) in NCU_MODE (default fwd;
#                train_safe reaches the backward's kernels) -> kernels.ncu-rep, details.txt
#                (every section as text), sass.csv (stall samples per instruction) and phases.txt (those samples
#                between barriers: benchmarks/ncu_phases.py); the counters need a Firecracker machine
#   tune-helion  `kda.bench --tune-kernels helion` at SHAPES in HELION_TUNE_MODES (default fwd and train_safe)
#                within HELION_TUNE_S seconds
#                (default 200) -> tune-helion/tuned_sm90.json, which the targets after it in the same run use
#                (KDA_HELION_CONFIGS); copy it over kda/backends/helion/tuned_sm90.json to ship it
#   tune-fla     in the background, while the targets after it run: FLA alone at SHAPES in MODES, once, so
#                that its autotuners (minutes per new shape) have tuned when a later `bench` times it; the
#                results are kept in state.tgz, the timings thrown away. Give it first: `tune-fla verify`
#
# Every step runs under one deadline (DEADLINE_S, default 560 s: the device tool stops a command at 600 s),
# so what finished comes back. At the end every output but state.tgz is packed into $OUT/outputs.tgz (the
# device tool brings back at most 8 files; `tar xzf outputs.tgz` gives the <target>/ folders and env.txt).
# Triton's autotune results (FLA tunes for minutes at each new shape), kda's records and timing table, and
# the card's name are packed into $OUT/state.tgz: keep it as .device/state.tgz and the next run on the same
# card starts from it (on another card it is left packed: Triton keys its results by architecture, not card,
# so an H100's choices would time FLA on an H200 at another card's tuning). A new machine here has no
# .device/: benchmarks/device/autotune/<gpu>.tgz, in git, holds one card's autotune results alone and is
# unpacked first (`bash benchmarks/device/keep_autotune.sh state.tgz GPU` refreshes it from a run's state;
# results of other Triton or FLA versions are ignored by Triton's own cache key). Curate the output into a
# snapshot with benchmarks/snapshot.py.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,20p "$0"; exit 2; }
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-560}
left() {  # seconds left, minus a reserve; at least 1 (`timeout` refuses a negative limit)
  local seconds=$(( DEADLINE_S - ($(date +%s) - START) - ${1:-0} ))
  echo $(( seconds > 0 ? seconds : 1 ))
}
OUT=${OUT:-/tmp/kda-out}
DENSE="B1_T8192_H96_D128 B2_T16384_H16_D128 B4_T2048_H16_D128 B4_T4096_H64_D128 B8_T2048_H32_D256 B8_T1024_H8_D64"
SHAPES=${SHAPES:-$DENSE}
SWEEP_SHAPE=${SWEEP_SHAPE:-B1_T8192_H96_D128}
ALL_BACKENDS="baseline:fla baseline:flashkda triton helion tilelang flashkda fla auto"

source .device/setup.sh
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1 KDA_CACHE_DIR=/tmp/kda-cache
export TILELANG_CACHE_DIR=/tmp/tilelang-cache  # compiled TileLang kernels: not kept (17 MB, past what comes back)
mkdir -p "$TRITON_CACHE_DIR" "$KDA_CACHE_DIR" "$TILELANG_CACHE_DIR" "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr '[:upper:]' '[:lower:]' \
  | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
GPU=${GPU:-unknown}
if [ ! -f /tmp/.kda-state-unpacked ]; then  # this card's autotune results in git, then this checkout's own state
  [ -f "benchmarks/device/autotune/$GPU.tgz" ] && tar xzf "benchmarks/device/autotune/$GPU.tgz" -C /tmp
  if [ -f .device/state.tgz ]; then
    kept_for=$(tar xzOf .device/state.tgz gpu.txt 2>/dev/null)
    if [ "$kept_for" = "$GPU" ]; then tar xzf .device/state.tgz -C /tmp kda-cache triton-cache 2>/dev/null
    else echo "measure.sh: .device/state.tgz was kept on '${kept_for:-an unnamed card}', this is '$GPU': not used"; fi
  fi
  touch /tmp/.kda-state-unpacked
fi
{ date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "cpus: $(nproc)"
  python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  python3 -m pip list 2>/dev/null | grep -i -E "^(fla-core|tokenspeed-flashkda|helion|tilelang|pydantic) "
  python3 -c "import kda; print(\"kda\", kda.__version__)"; } > "$OUT/env.txt" 2>&1

shape_args() { for shape in "$@"; do printf -- '--shape %s ' "$shape"; done; }
mode_args() { for mode in "$@"; do printf -- '--mode %s ' "$mode"; done; }
bench() {  # NAME RESERVE [kda.bench arguments]
  local name=$1 reserve=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout "$(left "$reserve")" python3 -m kda.bench "$@" --out "$OUT/$name" > "$OUT/$name/table.txt" 2> "$OUT/$name/log.txt"
  echo "$name: exit $?"; grep -E " ok | fail|rror| s: choosing " "$OUT/$name/log.txt" | head -40
}

for target in "$@"; do
  if [ "$(left 30)" -le 1 ]; then  # a target needs more than its reserve: say so rather than start it
    echo "$target: skipped, no time left before the deadline (DEADLINE_S=$DEADLINE_S)"; continue
  fi
  case "$target" in
  tune-fla)
    mkdir -p "$OUT/tune-fla"
    # shellcheck disable=SC2046
    timeout "$(left 15)" python3 -m kda.bench --backend baseline:fla --cold-start none --rounds 1 --rep-ms 20 \
      $(for m in ${MODES:-fwd}; do printf -- '--mode %s ' "$m"; done) $(shape_args $SHAPES) --out /tmp/tune-fla \
      > "$OUT/tune-fla/log.txt" 2>&1 &
    TUNING=$!
    ;;
  verify)
    name=${VERIFY_NAME:-verify}
    mkdir -p "$OUT/$name"
    limit=$(left 20); [ -n "${VERIFY_S:-}" ] && [ "$VERIFY_S" -lt "$limit" ] && limit=$VERIFY_S
    which="--all"; [ -n "${VERIFY_BACKENDS:-}" ] && which=$(printf -- '--backend %s ' $VERIFY_BACKENDS)
    cases="--with-bench-classes"  # a case file names its classes, bench ones included
    [ -n "${VERIFY_CASES_FILE:-}" ] && cases=$(printf -- '--case %s ' $(cat "$VERIFY_CASES_FILE"))
    [ -n "${VERIFY_MISSING:-}" ] && cases="$cases --missing"
    rm -rf "/tmp/$name-workers"
    # shellcheck disable=SC2086
    timeout "$limit" python3 -m kda.verify $which $cases --jobs "${VERIFY_JOBS:-12}" \
      --work-dir "/tmp/$name-workers" --json "$OUT/$name/verify.json" > "$OUT/$name/table.txt" 2> "$OUT/$name/log.txt"
    echo "$name: exit $?"; tar czf "$OUT/$name/workers.tgz" -C /tmp "$name-workers"  # one file: at most 8 come back
    tail -n 3 "$OUT/$name/table.txt"; grep -E "FAIL|fail " "$OUT/$name/table.txt" | head -20
    ;;
  bench)
    # shellcheck disable=SC2046
    bench bench 20 --tune $(printf -- '--backend %s ' ${BENCH_BACKENDS:-$ALL_BACKENDS}) \
      $(for m in ${MODES:-fwd}; do printf -- '--mode %s ' "$m"; done) --cold-start "${COLD:-first}" $(shape_args $SHAPES)
    ;;
  train-bench)
    # shellcheck disable=SC2046
    bench train-bench 20 --tune $(printf -- '--backend %s ' ${TRAIN_BACKENDS:-baseline:fla baseline:fla-tilelang fla triton helion tilelang auto}) \
      --mode train_safe --cold-start none $(shape_args $SHAPES)
    ;;
  decode)
    # shellcheck disable=SC2046
    bench decode 20 --tune --mode decode --backend baseline:fla --backend triton --backend fla --backend torch \
      --backend auto --graph $(shape_args ${DECODE_SHAPES:-})
    ;;
  decode-tune)
    mkdir -p "$OUT/decode-tune"
    timeout "$(left 20)" python3 benchmarks/decode_sweep.py --out "$OUT/decode-tune" > "$OUT/decode-tune/log.txt" 2>&1
    echo "decode-tune: exit $?"; grep -v -i warn "$OUT/decode-tune/log.txt" | grep -v '^{' | tail -60
    ;;
  graphs)
    mkdir -p "$OUT/graphs"
    timeout "$(left 20)" python3 -m pytest -q -p no:cacheprovider -ra -m gpu tests/test_compile.py tests/recurrent \
      > "$OUT/graphs/pytest.txt" 2>&1
    echo "graphs: exit $?"; tail -n 15 "$OUT/graphs/pytest.txt"
    ;;
  sweep)
    mkdir -p "$OUT/sweep"
    timeout "$(left 200)" python3 benchmarks/triton_stages.py --sweep "$SWEEP_SHAPE" > "$OUT/sweep/forward.txt" 2>&1
    for index in ${TRAIN_SWEEP:-0}; do
      SWEEP_INDEX=$index timeout "$(left 20)" python3 benchmarks/triton_stages.py --train-sweep "$SWEEP_SHAPE" \
        >> "$OUT/sweep/training.txt" 2>&1
    done
    cat "$OUT/sweep/forward.txt" "$OUT/sweep/training.txt" | grep -v -i warn | tail -40
    ;;
  profile)
    mkdir -p "$OUT/profile"
    for mode in ${MODES:-fwd train_safe}; do
      # shellcheck disable=SC2046
      KDA_VERIFY=off timeout "$(left 20)" python3 benchmarks/profile_kernels.py \
        $(printf -- '--backend %s ' ${PROFILE_BACKENDS:-baseline:fla triton}) \
        --mode "$mode" "$SWEEP_SHAPE" >> "$OUT/profile/kernels.txt" 2>&1
    done
    tail -n 40 "$OUT/profile/kernels.txt"
    ;;
  helion-stages)
    mkdir -p "$OUT/helion-stages"
    fault_case=${HELION_FAULT_CASE-safe/qk/sig2/fp16/varlen/gva/h0+ht/c64/d256/train}
    reserve=90; [ -z "$fault_case" ] && reserve=20  # time kept for the fault class's run, when there is one
    for mode in ${MODES:-fwd fwd_pregated train_safe}; do
      # shellcheck disable=SC2086
      KDA_VERIFY=off timeout "$(left $reserve)" python3 benchmarks/helion_stages.py --mode "$mode" \
        ${STAGE_SHAPES:-B4_T2048_H16_D128} >> "$OUT/helion-stages/kernels.txt" 2>&1
    done
    if [ -z "$fault_case" ]; then grep -v -i warn "$OUT/helion-stages/kernels.txt" | tail -60; continue; fi
    # the d256 training class that faulted, its own cases, each launch synchronized (names the kernel)
    timeout "$(left 20)" python3 benchmarks/helion_stages.py --sync-each \
      --case "$fault_case" > "$OUT/helion-stages/d256.txt" 2>&1
    fault=$?
    echo "helion-stages d256: exit $fault"
    if [[ $fault != 0 ]] && command -v compute-sanitizer > /dev/null; then
      # the same run under memcheck: the faulting access's kernel, address and thread (Firecracker
      # machines only; on gVisor the sanitizer refuses the device, which the file then says)
      timeout "$(left 15)" compute-sanitizer --tool memcheck --print-limit 8 python3 benchmarks/helion_stages.py \
        --sync-each --case "$fault_case" \
        > "$OUT/helion-stages/memcheck.txt" 2>&1
      echo "helion-stages memcheck: exit $?"; grep -m 20 -E "Invalid|at 0x|by thread|Address|ERROR SUMMARY" \
        "$OUT/helion-stages/memcheck.txt"
    fi
    grep -v -i warn "$OUT/helion-stages/kernels.txt" | tail -60; tail -n 12 "$OUT/helion-stages/d256.txt"
    ;;
  helion-decode)
    mkdir -p "$OUT/helion-decode"
    # shellcheck disable=SC2046
    timeout "$(left 10)" python3 benchmarks/helion_decode.py \
      $(for s in ${HELION_DECODE_SHAPES:-}; do printf -- '--shape %s ' "$s"; done) > "$OUT/helion-decode/log.txt" 2>&1
    echo "helion-decode: exit $?"; grep -v -i warn "$OUT/helion-decode/log.txt" | tail -n 30
    ;;
  helion-compile)
    mkdir -p "$OUT/helion-compile"
    for mode in ${HELION_COMPILE_MODES:-fwd train_safe}; do
      caches=/tmp/helion-compile-$mode; rm -rf "$caches"
      for run in cold warm triton-only; do
        switch=1; [ "$run" = triton-only ] && switch=0
        printf '%s %s ' "$mode" "$run" >> "$OUT/helion-compile/times.txt"
        KDA_VERIFY=off KDA_HELION_CODE_CACHE=$switch TRITON_CACHE_DIR=$caches/triton TORCHINDUCTOR_CACHE_DIR=$caches/inductor \
          timeout "$(left 20)" python3 -m kda.bench.cold --backend helion --mode "$mode" \
          --shape "${HELION_COMPILE_SHAPE:-B1_T8192_H96_D128}" >> "$OUT/helion-compile/times.txt" 2>> "$OUT/helion-compile/log.txt"
        echo " exit $?" >> "$OUT/helion-compile/times.txt"
      done
    done
    cat "$OUT/helion-compile/times.txt"; grep -v -i warn "$OUT/helion-compile/log.txt" | tail -n 5
    ;;
  helion-halves)
    mkdir -p "$OUT/helion-halves"
    KDA_VERIFY=off timeout "$(left 10)" python3 benchmarks/helion_halves.py \
      ${HALVES_SHAPES:-B4_T2048_H16_D128 B1_T8192_H96_D128} > "$OUT/helion-halves/log.txt" 2>&1
    echo "helion-halves: exit $?"; grep -v -i warn "$OUT/helion-halves/log.txt" | tail -n 30
    ;;
  cp-scaling)
    mkdir -p "$OUT/cp-scaling"
    gpus=$(nvidia-smi -L | wc -l)
    for backend in ${CP_BACKENDS:-triton}; do
      for set in ${CP_SETS:-32768,131072,262144:32 131072:96}; do
        tokens=${set%%:*}; heads=${set##*:}
        for w in 1 2 4 8; do
          [ "$w" -le "$gpus" ] || continue
          check=(); [ "$w" -gt 1 ] && check=(--check)
          # shellcheck disable=SC2046
          NCCL_NVLS_ENABLE=0 timeout "$(left 30)" torchrun --nproc-per-node "$w" benchmarks/cp_scaling.py \
            --tokens ${tokens//,/ } --heads "$heads" --backend "$backend" "${check[@]}" \
            --out "$OUT/cp-scaling/times.jsonl" >> "$OUT/cp-scaling/log.txt" 2>&1
          echo "cp-scaling $backend $set W=$w: exit $?"
        done
      done
    done
    python3 benchmarks/cp_scaling.py --report "$OUT/cp-scaling/times.jsonl" | tee "$OUT/cp-scaling/report.txt"
    ;;
  tune-helion)
    mkdir -p "$OUT/tune-helion"
    cp kda/backends/helion/tuned_sm90.json "$OUT/tune-helion/tuned_sm90.json"  # the tuner adds to the shipped entries
    # shellcheck disable=SC2046
    timeout "$(left 20)" python3 -m kda.bench --tune-kernels helion --tune-budget-s "${HELION_TUNE_S:-200}" \
      --table "$OUT/tune-helion/tuned_sm90.json" $(shape_args $SHAPES) $(mode_args ${HELION_TUNE_MODES:-}) > "$OUT/tune-helion/log.txt" 2>&1
    echo "tune-helion: exit $?"; grep -v -i warn "$OUT/tune-helion/log.txt" | tail -40
    [ -f "$OUT/tune-helion/tuned_sm90.json" ] && export KDA_HELION_CONFIGS="$OUT/tune-helion/tuned_sm90.json"
    ;;
  tilelang-compile)
    mkdir -p "$OUT/tilelang-compile"
    for mode in ${TILELANG_COMPILE_MODES:-fwd}; do
      timeout "$(left 20)" python3 benchmarks/tilelang_compile.py --head-dims "${TILELANG_DIMS:-64,128,256}" \
        --mode "$mode" >> "$OUT/tilelang-compile/times.jsonl" 2>> "$OUT/tilelang-compile/log.txt"
    done
    echo "tilelang-compile: exit $?"; cat "$OUT/tilelang-compile/times.jsonl"; tail -n 5 "$OUT/tilelang-compile/log.txt"
    ;;
  tilelang-stages)
    mkdir -p "$OUT/tilelang-stages"
    # shellcheck disable=SC2046,SC2086
    KDA_VERIFY=off timeout "$(left 20)" python3 benchmarks/tilelang_stages.py \
      $(for m in ${STAGE_MODES:-fwd fwd_pregated}; do printf -- '--mode %s ' "$m"; done) \
      $(for v in ${VARIANTS:-}; do printf -- '--variant %s ' "$v"; done) \
      $(for p in ${PLANS:-}; do printf -- '--plan %s ' "$p"; done) \
      ${STAGE_SHAPES:-B1_T8192_H96_D128 B4_T2048_H16_D128} > "$OUT/tilelang-stages/kernels.txt" 2>&1
    echo "tilelang-stages: exit $?"; grep -v -i -E "warn|tilelang\.jit|decision" "$OUT/tilelang-stages/kernels.txt" | tail -40
    ;;
  tilelang-ncu)
    # Nsight Compute on the tilelang kernels matching NCU_KERNELS at NCU_SHAPE (it reads the counters on a
    # Firecracker machine, not on gVisor): every section, and the SASS with its stall samples per instruction
    mkdir -p "$OUT/tilelang-ncu"
    if command -v ncu > /dev/null; then
      KDA_VERIFY=off timeout "$(left 20)" ncu --clock-control none --set full --kernel-name regex:"${NCU_KERNELS:-intra}" \
        --launch-count "${NCU_LAUNCHES:-1}" -f -o "$OUT/tilelang-ncu/kernels" python3 benchmarks/tilelang_stages.py \
        --mode "${NCU_MODE:-fwd}" --steps 1 "${NCU_SHAPE:-B1_T8192_H96_D128}" > "$OUT/tilelang-ncu/log.txt" 2>&1
      echo "tilelang-ncu: exit $?"; tail -n 5 "$OUT/tilelang-ncu/log.txt"
      if [ -f "$OUT/tilelang-ncu/kernels.ncu-rep" ]; then
        ncu -i "$OUT/tilelang-ncu/kernels.ncu-rep" --print-details all > "$OUT/tilelang-ncu/details.txt" 2>&1
        ncu -i "$OUT/tilelang-ncu/kernels.ncu-rep" --page source --print-source sass --csv \
          > "$OUT/tilelang-ncu/sass.csv" 2>&1
        python3 benchmarks/ncu_phases.py "$OUT/tilelang-ncu/sass.csv" > "$OUT/tilelang-ncu/phases.txt" 2>&1
        grep -E "Duration|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Issue Slots Busy" \
          "$OUT/tilelang-ncu/details.txt" | head -8; cat "$OUT/tilelang-ncu/phases.txt"
      fi
    else
      echo "tilelang-ncu: no ncu on this machine"
    fi
    ;;
  tests)
    mkdir -p "$OUT/tests"
    if [ -n "${TEST_GROUPS:-}" ]; then  # one pytest process a group, side by side: TileLang compiles dominate
      i=0; pids=()
      IFS=';' read -ra groups <<< "$TEST_GROUPS"
      for group in "${groups[@]}"; do
        i=$((i + 1)); echo "$group" > "$OUT/tests/group-$i.args"
        # shellcheck disable=SC2086
        timeout "$(left 20)" python3 -m pytest -q -p no:cacheprovider -ra $group > "$OUT/tests/pytest-$i.txt" 2>&1 &
        pids+=($!)
      done
      wait "${pids[@]}"
      for n in $(seq 1 "$i"); do
        echo "== group $n: $(cat "$OUT/tests/group-$n.args")"
        grep -E "^(FAILED|ERROR)" "$OUT/tests/pytest-$n.txt" | head -12; tail -n 2 "$OUT/tests/pytest-$n.txt"
      done
    else
      # shellcheck disable=SC2086
      timeout "$(left 20)" python3 -m pytest -q -p no:cacheprovider -ra ${TESTS:-tests} > "$OUT/tests/pytest.txt" 2>&1
      grep -E "^(FAILED|ERROR)" "$OUT/tests/pytest.txt" | head -30; tail -n 15 "$OUT/tests/pytest.txt"
    fi
    ;;
  *)
    echo "measure.sh: unknown target '$target' (tune-fla, verify, bench, train-bench, decode, decode-tune, graphs, sweep, profile, helion-stages, helion-decode, helion-compile, helion-halves, cp-scaling, tune-helion, tilelang-compile, tilelang-stages, tilelang-ncu, tests)" >&2
    exit 2
    ;;
  esac
done

[ -n "${TUNING:-}" ] && { wait "$TUNING"; echo "tune-fla: exit $?"; tail -n 3 "$OUT/tune-fla/log.txt"; }
(cd /tmp && find triton-cache -name '*.autotune.json' > /tmp/autotune.list 2>/dev/null && echo "$GPU" > gpu.txt
 tar czf "$OUT/state.tgz" gpu.txt kda-cache -T /tmp/autotune.list 2>/dev/null)
(cd "$OUT" && tar czf /tmp/outputs.tgz --exclude=./state.tgz . && find . -type f ! -name state.tgz -delete \
 && find . -mindepth 1 -type d -empty -delete && mv /tmp/outputs.tgz outputs.tgz)
ls -la "$OUT"
