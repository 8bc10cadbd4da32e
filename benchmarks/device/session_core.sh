#!/usr/bin/env bash
# Device-session script for the core (issue 2), run on the lent H200 from the repo root:
#
#   device run, carry [".device"]:  bash benchmarks/device/session_core.sh
#
# 1. records the machine and versions; 2. `python -m kda.verify --all` on CUDA (the torch backend over
# the whole grid, bf16/fp16/fp32, forward and training, allocator poisoning live); 3. the test suite,
# whose CUDA-only tests run there; 4. what the torch fallback costs there. Everything lands under $OUT (copied to benchmarks/results/).
set -uo pipefail
source .device/setup.sh
export KDA_CACHE_DIR=/tmp/kda-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 - <<'PY'
import sys, torch, importlib.metadata as md
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
for d in ("triton", "pydantic", "rich", "fla-core", "tokenspeed-flashkda", "helion"):
    try: print(d, md.version(d))
    except md.PackageNotFoundError: print(d, "not installed")
print("device", torch.cuda.get_device_name(), "cc", torch.cuda.get_device_capability())
PY
} 2>&1 | tee "$OUT/env.txt"
python3 -m kda.verify --all --json "$OUT/verify-cuda.json" 2>"$OUT/verify-progress.txt" | tee "$OUT/verify-cuda.txt"
echo "kda.verify exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/verify-cuda.txt"
python3 -m pytest -q -p no:cacheprovider -ra tests 2>&1 | tail -25 | tee "$OUT/pytest-cuda.txt"
python3 benchmarks/torch_fallback_timing.py --json "$OUT/torch-fallback.json" 2>&1 | tee "$OUT/torch-fallback.txt"
