#!/usr/bin/env bash
# A GDN-only copy of the library with SRC.cu in place of kernels/gdn/dqkwg_sm90.cu, built here (no GPU
# needed, ~50 s on 2 cores) from a configured build's objects: about 7 MB, so several variants travel to
# the device in one call (the whole library, ~39 MB, leaves room for one) and no device build is needed.
#   BUILD=/tmp/bd bench/experiments/gdn_variant.sh NAME SRC.cu [nvcc options...]  ->  .variants/NAME.so
# The loss and RMSNorm kernels are left out: their entry points abort if called (stubs), the GDN ones
# work. Time variants against each other in one process with gdn_ab.py (the folder is git-ignored;
# name it in the device call's carry).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
name=$1 src=$(realpath "$2"); shift 2
build=$(realpath "${BUILD:-$root/build}")
dir=$build/CMakeFiles/headloss_cuda.dir  # the CUDA side's objects and flags (src/'s: headloss_host.dir)
[ -f "$dir/flags.make" ] || { echo "no configured CUDA build at $build (set BUILD)" >&2; exit 1; }
out=$root/.variants tmp=$build/gdn-variants
mkdir -p "$out" "$tmp"
read -r -a flags <<<"$(sed -n 's/^CUDA_DEFINES = //p; s/^CUDA_FLAGS = //p' "$dir/flags.make" | tr '\n' ' ')"
(cd "$build" && "${NVCC:-nvcc}" "${flags[@]}" --options-file "$dir/includes_CUDA.rsp" -c "$src" -o "$tmp/$name.o")
mapfile -t objs < <(find "$dir" "$build/CMakeFiles/headloss_host.dir" -name '*.o' |
                    grep -v -E '/kernels/(loss|rmsnorm)/|/dqkwg_sm90\.cu\.o$')
link() { c++ -shared -fPIC -o "$out/$name.so" "${objs[@]}" "$tmp/$name.o" "$@" -Wl,--version-script="$root/src/headloss.map" \
  -Wl,-soname,libheadloss.so.0 -L/usr/local/cuda/lib64 -lcudart_static -ldl -lrt -lpthread -Wl,--no-undefined; }
# Stubs for what the left-out kernels defined: an abort under each undefined (mangled) name.
link -Wl,--no-demangle 2>&1 | sed -n "s/.*undefined reference to \`\(.*\)'.*/\1/p" | sort -u |
  awk '{ printf "void stub%d(void) __asm__(\"%s\");\nvoid stub%d(void) { __builtin_trap(); }\n", NR, $0, NR }' >"$tmp/stubs.c" || true
cc -c -fPIC -O2 "$tmp/stubs.c" -o "$tmp/stubs.o"
link "$tmp/stubs.o"
echo "$out/$name.so"
