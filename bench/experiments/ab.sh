#!/usr/bin/env bash
# A/B of kernel variants in one device call: builds the library as the tree is (variant "base"),
# then with each patch applied on top, keeping a copy of each build, and runs a benchmark
# command against each. Usage (on the device, after tools/device.sh build):
#   bench/experiments/ab.sh "python3 bench/bench_loss.py --no-compile" a.patch b.patch ...
# The command sees HEADLOSS_LIBRARY set to the variant's library (/tmp/ab-<name>.so, kept for
# later tests); output goes to $OUT/ab-<name>.txt. lib/ and the build are left as the tree is.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/headloss-out}
cmd=$1; shift
libs=()
build() {  # $1: variant name
  cmake --build build-device -j "$(nproc)" --target headloss >/dev/null 2>"$OUT/ab-build-$1.txt" ||
    { tail -20 "$OUT/ab-build-$1.txt"; return 1; }
}
variant() { build "$1" && cp -L lib/libheadloss.so "/tmp/ab-$1.so" && libs+=("$1"); }
variant base
for p in "$@"; do
  name=$(basename "$p" .patch)
  patch -p1 -s <"$p" && { variant "$name"; patch -p1 -R -s <"$p"; }
done
for name in "${libs[@]}"; do
  echo "== $name"
  HEADLOSS_LIBRARY=/tmp/ab-$name.so $cmd 2>&1 | tee "$OUT/ab-$name.txt" | grep -E "^\|" | tail -12
done
# Back to the tree's build. The patched files are touched first: a later call's copy of the tree
# gives them their older mtime again, and its build would keep the last variant's objects.
if [ $# -gt 0 ]; then
  sed -n 's#^+++ b/\([^[:space:]]*\).*#\1#p' "$@" | sort -u | xargs -r touch
  build restore
fi
