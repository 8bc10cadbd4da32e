#!/usr/bin/env bash
# Keep the Triton autotune results of a device run in git, so that a new machine starts tuned:
#
#   bash benchmarks/device/keep_autotune.sh STATE_TGZ
#
# STATE_TGZ is the state.tgz a `measure.sh` run returned. Its triton-cache/**/*.autotune.json (FLA's and
# kda's autotuners' choices, a few KB each; measure.sh started from benchmarks/device/autotune.tgz, so they
# include what that held) replace benchmarks/device/autotune.tgz, packed deterministically (sorted, no
# times, no owners) so that an unchanged set gives an unchanged file. kda's verification records and
# timing table in STATE_TGZ stay out: they certify one machine's runs, not a checkout.
set -euo pipefail
state=${1:?usage: bash benchmarks/device/keep_autotune.sh STATE_TGZ}
[ -f "$state" ] || { echo "keep_autotune.sh: $state: no such file" >&2; exit 2; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if ! tar xzf "$state" -C "$scratch" --wildcards 'triton-cache/*' 2>/dev/null; then
  echo "keep_autotune.sh: $state holds no autotune results (triton-cache/)" >&2
  exit 1
fi
(cd "$scratch" && find triton-cache -type f ! -name '*.autotune.json' -delete)
count=$(find "$scratch/triton-cache" -name '*.autotune.json' | wc -l)
tar czf "$(dirname "$0")/autotune.tgz" -C "$scratch" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner triton-cache
echo "benchmarks/device/autotune.tgz: $count autotune results"
