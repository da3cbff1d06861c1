#!/usr/bin/env bash
# The GPU benchmarks (`make bench`; tools/device.sh's bench step): bench/bench_NAME.py for each NAME
# given (default: every one), and the C latency benchmark with rmsnorm. Each prints its table and
# writes it to $OUT/bench_NAME.md (default bench/out/). To keep a run: `tools/results.py add NAME
# $OUT/bench_NAME.md` appends its values to bench/results/NAME.csv (the table and its notes go to
# bench/results/NAME_<device>.md).
# Needs a GPU, PyTorch and the built library; BUILD names the build folder (default build),
# HL_BENCH_ARGS="..." adds arguments to every bench script (shell-quoted: '--only "odd K"').
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
BUILD=${BUILD:-build}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export HEADLOSS_LIBRARY=${HEADLOSS_LIBRARY:-$PWD/lib/libheadloss.so} PYTHONUNBUFFERED=1
if ! "$PY" -c "import sys, headloss; sys.exit(not headloss.cuda_available())" 2>/dev/null; then
  echo "bench: no GPU, or the library has no CUDA backend: nothing to measure" >&2
  exit 1
fi
names=("$@")
[ ${#names[@]} -eq 0 ] && mapfile -t names < <(ls bench/bench_*.py | sed 's#bench/bench_\(.*\)\.py#\1#')
eval "extra=(${HL_BENCH_ARGS:-})"
status=0
for n in "${names[@]}"; do
  echo "== bench $n"
  timeout 300 "$PY" "bench/bench_$n.py" --out "$OUT/bench_$n.md" "${extra[@]}" 2>&1 | tail -40 || status=1
  if [ "$n" = rmsnorm ] && [ -x "$BUILD/bench/rmsnorm_latency" ]; then
    "$BUILD/bench/rmsnorm_latency" | tee "$OUT/rmsnorm_latency.txt" || status=1
  fi
done
exit $status
