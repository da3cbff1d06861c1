#!/usr/bin/env bash
# A/B of this tree against another one (an older commit: `git archive <commit> | tar -x -C .ab_old`,
# carried to the device), each with its own library and Python package, in one device call.
# Usage (on the device, after tools/device.sh build):
#   bench/experiments/tree_ab.sh OTHER_TREE ROUNDS "python3 $PWD/bench/experiments/ce_time.py 8192x128256"
# builds OTHER_TREE's library, then runs the command ROUNDS times for each tree, alternating (the
# GPU's clocks drift over a call: interleaving shows it), with PYTHONPATH=<tree>/python:<tree>/bench
# and HEADLOSS_LIBRARY=<tree>/lib/libheadloss.so. Output: $OUT/tree-ab.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/headloss-out}
other=$(cd "$1" && pwd) rounds=$2 cmd=$3
cmake -S "$other" -B "$other/build-device" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DHL_BUILD_TESTS=OFF >/dev/null &&
  cmake --build "$other/build-device" -j "$(nproc)" --target headloss >/dev/null 2>"$OUT/tree-ab-build.txt" ||
  { tail -20 "$OUT/tree-ab-build.txt"; exit 1; }
for ((i = 1; i <= rounds; ++i)); do
  for tree in "$PWD" "$other"; do
    echo "== round $i: $tree" | tee -a "$OUT/tree-ab.txt"
    PYTHONPATH=$tree/python:$tree/bench${PYTHONPATH:+:$PYTHONPATH} HEADLOSS_LIBRARY=$tree/lib/libheadloss.so \
      $cmd 2>&1 | tee -a "$OUT/tree-ab.txt"
  done
done
