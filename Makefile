# Thin wrapper over CMake. Two commands set up and use a fresh Debian/Ubuntu machine:
#   make run    installs what is missing, builds spes-engine alone and runs the tiny
#               4-node SPES job; stdout is its CSV from the first line, everything
#               else (apt, cmake, compiler, progress) goes to stderr
#   make test   installs what is missing, builds everything, runs every test
BUILD ?= build
JOBS ?= $(shell nproc)
CUDA_ARCHS ?= 90
CMAKE_FLAGS ?=
# Extra arguments for the demo, e.g. RUN_ARGS='--set train.steps=20'.
RUN_ARGS ?=

.PHONY: all deps deps-if-missing test-deps-if-missing configure engine build test run demo-data bench gpu-check-bundle clean

all: build

DEB_PACKAGES = cmake g++ make libboost-program-options-dev libboost-system-dev libflatbuffers-dev \
  flatbuffers-compiler libtoml11-dev doctest-dev libopenblas-dev libgfortran-12-dev \
  nlohmann-json3-dev libssl-dev libpcre2-dev libutf8proc-dev zlib1g-dev libzstd-dev
# Only the tests need these (the status page test loads the page in headless Chromium):
# `make deps` and `make test` install them, `make run` does not.
TEST_DEB_PACKAGES = chromium
DEPS ?= $(DEB_PACKAGES) $(TEST_DEB_PACKAGES)

# Installs every package (apt-get update first), or those DEPS names.
deps:
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	  $(DEPS)

# Install only when a package is missing: the build's (run starts here), and the
# tests' too (test starts here).
deps-if-missing:
	@dpkg -s $(DEB_PACKAGES) > /dev/null 2>&1 || $(MAKE) --no-print-directory deps DEPS="$(DEB_PACKAGES)"

test-deps-if-missing:
	@dpkg -s $(DEB_PACKAGES) $(TEST_DEB_PACKAGES) > /dev/null 2>&1 || $(MAKE) --no-print-directory deps

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$(CUDA_ARCHS)" $(CMAKE_FLAGS)

configure: $(BUILD)/CMakeCache.txt

# spes-engine alone: what `make run` needs (no tests, no benches).
engine: deps-if-missing configure
	cmake --build $(BUILD) -j $(JOBS) --target spes-engine

build: deps-if-missing configure
	cmake --build $(BUILD) -j $(JOBS)

# Two tests at a time: the longest use every core themselves (the GPU emulator's
# workers, OpenMP), many others mostly wait on sockets and timeouts.
test: test-deps-if-missing build
	cd $(BUILD) && ctest --output-on-failure -j 2

DEMO_DATA = runs/data/tinyshakespeare

$(DEMO_DATA)/train.manifest: data/corpus/tinyshakespeare.txt
	./$(BUILD)/spes-engine tokenize --input $< --out $(DEMO_DATA) --val-fraction 0.05

demo-data: $(DEMO_DATA)/train.manifest

# Every step before the run writes to stderr, so `make run > run.csv` is pure CSV. A new
# run moves an earlier one's folder aside (local refuses to start over a run's state);
# RUN_ARGS=--resume continues it instead.
DEMO_RUN = runs/tiny

run:
	@$(MAKE) --no-print-directory engine >&2
	@$(MAKE) --no-print-directory demo-data >&2
	@$(if $(filter --resume,$(RUN_ARGS)),true,if [ -e $(DEMO_RUN) ]; then \
	  aside=$(DEMO_RUN)-$$(date +%Y%m%d-%H%M%S-%N); mv $(DEMO_RUN) $$aside; \
	  echo "make run: the earlier run moved to $$aside (RUN_ARGS=--resume continues a run)" >&2; fi)
	@./$(BUILD)/spes-engine local configs/tiny.toml $(RUN_ARGS)

bench: build
	@for b in $(BUILD)/bench_*; do echo "== $$b"; $$b || exit 1; done

# The one-call GPU check, built here without a GPU (bench/gpu_check/): portable sm_90
# binaries (static runtimes, SPES_PORTABLE), configs, tokenized data, run.sh and the
# PyTorch anchors in $(GPU_BUILD)/gpu-check/. On a GPU machine:
# $(GPU_BUILD)/gpu-check/run.sh [--full] OUTDIR (quick: ≤ 5 min; full: ≤ 8 min).
GPU_BUILD ?= build-gpu

gpu-check-bundle:
	cmake -S . -B $(GPU_BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DSPES_CUDA=ON -DSPES_PORTABLE=ON
	cmake --build $(GPU_BUILD) -j $(JOBS)
	bench/gpu_check/bundle.sh $(GPU_BUILD) $(GPU_BUILD)/gpu-check

clean:
	rm -rf $(BUILD)
