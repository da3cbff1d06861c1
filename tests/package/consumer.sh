#!/usr/bin/env bash
# The installed package as a project outside the tree sees it: `cmake --install` of the build into a
# scratch prefix, then examples/consumer built against it twice, through find_package(headloss)
# and through pkg-config, and run. Usage: consumer.sh BUILD_DIR WORK_DIR (CTest passes both).
set -euo pipefail
build=$1 work=$2
src=$(cd "$(dirname "$0")/../../examples/consumer" && pwd)
rm -rf "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null

echo "== find_package(headloss)"
cmake -S "$src" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/cmake" >/dev/null
"$work/cmake/consumer"

echo "== pkg-config headloss (docs/abi.md's two ways to find the library at run time)"
pc=$(dirname "$(find "$work/prefix" -name headloss.pc)")
export PKG_CONFIG_PATH=$pc
# shellcheck disable=SC2046  # the flags are meant to split
cc -std=c99 "$src/consumer.c" -o "$work/pc_consumer" $(pkg-config --cflags --libs headloss) -lm \
  -Wl,-rpath,"$(pkg-config --variable=libdir headloss)"
"$work/pc_consumer"
# shellcheck disable=SC2046
cc -std=c99 "$src/consumer.c" -o "$work/pc_consumer_norpath" $(pkg-config --cflags --libs headloss) -lm
LD_LIBRARY_PATH="$(pkg-config --variable=libdir headloss)" "$work/pc_consumer_norpath"
