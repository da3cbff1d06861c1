# The front door. `make demo` runs the main job, `make test` every test (it installs what a fresh
# machine lacks), `make bench` the GPU benchmarks, `make device` what the GPU machine runs.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all lib demo test bench device clean

all: lib

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

lib: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

demo: lib
	$(BUILD)/examples/loss_demo

test:
	tools/test.sh

bench: lib
	tools/bench.sh

device:
	tools/device.sh

clean:
	rm -rf $(BUILD) build-asan lib/libheadloss.so*
