#!/usr/bin/env bash
# Keep the Triton autotune results of a device run in git, so that a new machine of that GPU starts tuned:
#
#   bash benchmarks/device/keep_autotune.sh STATE_TGZ GPU
#
# STATE_TGZ is the state.tgz a `measure.sh` run returned; GPU is the card it ran on, as nvidia-smi names it
# or as its results folder does ("NVIDIA H100 80GB HBM3" or "nvidia-h100-80gb-hbm3"). Its
# triton-cache/**/*.autotune.json (FLA's and kda's autotuners' choices, a few KB each; measure.sh started
# from the same card's archive, so they include what that held) replace
# benchmarks/device/autotune/<gpu>.tgz, packed deterministically (sorted, no times, no owners) so that an
# unchanged set gives an unchanged file. One archive a card: Triton's cache key names the architecture
# (sm_90), not the card, so an H100's choices would be taken on an H200 and FLA timed at another card's
# tuning. kda's verification records and timing table in STATE_TGZ stay out: they certify one machine's
# runs, not a checkout.
set -euo pipefail
state=${1:?usage: bash benchmarks/device/keep_autotune.sh STATE_TGZ GPU}
gpu=${2:?usage: bash benchmarks/device/keep_autotune.sh STATE_TGZ GPU}
slug=$(printf '%s' "$gpu" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
[ -n "$slug" ] || { echo "keep_autotune.sh: '$gpu' names no GPU" >&2; exit 2; }
[ -f "$state" ] || { echo "keep_autotune.sh: $state: no such file" >&2; exit 2; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if ! tar xzf "$state" -C "$scratch" --wildcards 'triton-cache/*' 2>/dev/null; then
  echo "keep_autotune.sh: $state holds no autotune results (triton-cache/)" >&2
  exit 1
fi
(cd "$scratch" && find triton-cache -type f ! -name '*.autotune.json' -delete)
count=$(find "$scratch/triton-cache" -name '*.autotune.json' | wc -l)
kept="$(dirname "$0")/autotune/$slug.tgz"
mkdir -p "$(dirname "$kept")"
tar czf "$kept" -C "$scratch" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner triton-cache
echo "benchmarks/device/autotune/$slug.tgz: $count autotune results"
