#!/usr/bin/env bash
# Builds the library and runs every test: the cmocka C tests through CTest (also against an ASan +
# UBSan build of the CPU backend), then pytest.
# On a fresh machine it installs cmocka (apt-get, when root) and NumPy + pytest + ml_dtypes + jax
# (CPU) into a local venv (.venv). GPU tests run when a GPU is visible and skip with a reason
# otherwise.
# HL_PYTHON=python3 uses that interpreter instead of the venv (the GPU machine's, with torch).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}

if ! pkg-config --exists cmocka 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing cmocka"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libcmocka-dev pkg-config >/dev/null
  else
    echo "== cmocka missing and not root: the C tests will not be built" >&2
  fi
fi

if [ -n "${HL_PYTHON:-}" ]; then
  PY=$HL_PYTHON
else
  if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv"
    python3 -m venv .venv
  fi
  PY=$PWD/.venv/bin/python
  # jax (CPU): the JAX adapter builds against its FFI headers and its tests run on the CPU backend.
  "$PY" -c "import numpy, pytest, ml_dtypes, jax" 2>/dev/null ||
    "$PY" -m pip install -q numpy pytest ml_dtypes jax
  export HL_PIP_TEST=${HL_PIP_TEST:-1}  # tests/python/test_package.py: pip wheel . (needs PyPI)
fi

echo "== building"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DHL_JAX_PYTHON="$PY" ${CMAKE_FLAGS:-} >/dev/null
cmake --build "$BUILD" -j "$(nproc)"

echo "== C tests (cmocka)"
ctest --test-dir "$BUILD" --output-on-failure

# The same C tests against a CPU-only library built with ASan + UBSan (any report fails the test);
# its library stays in its own build tree, not in lib/ where the Python tests load theirs.
ASAN_BUILD=${ASAN_BUILD:-build-asan}
echo "== C tests under ASan + UBSan ($ASAN_BUILD)"
cmake -S . -B "$ASAN_BUILD" -DCMAKE_BUILD_TYPE=Debug -DHL_CUDA=OFF -DHL_SANITIZE=ON \
  -DHL_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$ASAN_BUILD" -j "$(nproc)"
ctest --test-dir "$ASAN_BUILD" --output-on-failure

echo "== Python tests (pytest)"
HEADLOSS_LIBRARY="$PWD/lib/libheadloss.so" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest tests/python -q -rs "$@"
