#!/usr/bin/env bash
# What the GPU machine runs, in one call: build for Hopper, run every test (GPU ones for real),
# run GPU tests under compute-sanitizer (memcheck, racecheck), run the benchmarks, and leave
# logs and tables in $OUT. Steps: tools/device.sh [build] [test] [sanitize] [bench-NAME ...]
# (default: all; bench-NAME runs bench/bench_NAME.py; `bench` runs every benchmark).
# HL_TESTS="tests/python/test_x.py ..." limits the test step to those pytest arguments (shell-quoted:
# HL_TESTS='tests/python/test_gdn.py -k "cuda and K100"'), HL_SANITIZE="rms gdn"
# the sanitizer step to those families (rms, loss, linear, tp, gdn), HL_BENCH_ARGS="..." adds arguments to
# every bench-NAME script (tools/bench.sh). HL_COMMIT=<hash> names the commit in the benchmark tables (the device's
# copy of the tree has no current .git).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/headloss-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test sanitize bench)
want() { local s; for s in "${steps[@]}"; do [[ $s == "$1" || $s == "$1"-* && $1 == bench ]] && return 0; done; return 1; }
status=0

export NCCL_NVLS_ENABLE=0
# Carried peer wheels (see bench/NOTES.md): installed into a private folder.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} HEADLOSS_LIBRARY=$PWD/lib/libheadloss.so PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"

# Always build: the other steps need the library.
echo "== build (sm_90a; ptxas report in $OUT/ptxas.txt)"
cmake -S . -B build-device -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DHL_PTXAS_VERBOSE=ON -DHL_BUILD_TESTS=OFF >/dev/null &&
  cmake --build build-device -j "$(nproc)" 2>"$OUT/ptxas.txt" >/dev/null || { tail -40 "$OUT/ptxas.txt"; exit 1; }
grep -E "spill" "$OUT/ptxas.txt" | grep -v " 0 bytes spill stores, 0 bytes spill loads" | sort | uniq -c | head -20

if want test; then
  echo "== tests"
  eval "tests=(${HL_TESTS:-tests/python})"
  python3 -m pytest "${tests[@]}" -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  build-device/examples/rmsnorm_example || status=1
fi

if want sanitize; then
  # Every kernel family, in both a 16-bit and the fp32 dtype where it has one (the whole suite
  # is too slow under the sanitizer).
  rms=(tests/python/test_rmsnorm.py::test_gpu_in_place_and_deterministic
       "tests/python/test_rmsnorm.py::test_gpu_forward_weight_of_x_dtype[bfloat16-1000]"
       "tests/python/test_rmsnorm.py::test_gpu_forward_weight_of_x_dtype[float16-2048]")
  for case in bfloat16-128 float32-1000 bfloat16-4096 bfloat16-12296 float16-16384 bfloat16-16392 bfloat16-24584 bfloat16-40000 bfloat16-131072; do
    rms+=("tests/python/test_rmsnorm.py::test_gpu_forward[$case]" "tests/python/test_rmsnorm.py::test_gpu_backward[$case]")
  done
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool (GPU tests, a subset of sizes)"
    rc=0
    for sel in ${HL_SANITIZE:-rms loss linear tp gdn}; do
      case $sel in
        rms) args=("${rms[@]}") ;;
        loss) args=(tests/python/test_loss.py -k "cuda and ((all or entropy or distill_fwd) and (bfloat16 or float32) or bulk_many_rows and grpo_kl)") ;;
        linear) args=(tests/python/test_linear_loss.py -k "cuda and (all and bfloat16 or fused_teacher or accumulate or chunks or equals_logits or sharded and 2)") ;;
        tp) args=(tests/python/test_loss_tp.py -k "cuda and (all or ce_smooth) and bfloat16") ;;
        gdn) args=(tests/python/test_gdn.py -k "cuda_fp32_state or cuda_fused_cumsum") ;;  # both kernels
      esac
      [ -e "${args[0]%%::*}" ] || continue
      timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 --target-processes all \
        python3 -m pytest -q -p no:cacheprovider "${args[@]}" >"$OUT/sanitize-$tool-$sel.txt" 2>&1 || rc=$?
      echo "$sel: $(tail -1 "$OUT/sanitize-$tool-$sel.txt")"
    done
    [ $rc = 0 ] || { echo "sanitizer $tool: exit $rc"; status=1; }
  done
fi

names=()
for s in "${steps[@]}"; do
  case $s in
    bench) mapfile -t -O "${#names[@]}" names < <(ls bench/bench_*.py | sed 's#bench/bench_\(.*\)\.py#\1#') ;;
    bench-*) names+=("${s#bench-}") ;;
  esac
done
if [ ${#names[@]} -gt 0 ]; then
  BUILD=build-device OUT=$OUT tools/bench.sh "${names[@]}" || status=1
fi
exit $status
