# Thin wrapper over CMake. `make deps` installs what the build needs (Debian);
# `make test` builds everything and runs every test; `make run` is the demo job.
BUILD ?= build
JOBS ?= $(shell nproc)
CUDA_ARCHS ?= 90
CMAKE_FLAGS ?=

.PHONY: all deps configure build test run bench clean

all: build

deps:
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	  cmake g++ make libboost-program-options-dev libboost-system-dev libflatbuffers-dev \
	  flatbuffers-compiler libtoml11-dev doctest-dev libopenblas-dev libgfortran-12-dev \
	  nlohmann-json3-dev libssl-dev libpcre2-dev libutf8proc-dev

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$(CUDA_ARCHS)" $(CMAKE_FLAGS)

configure: $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j 1

DEMO_DATA = runs/data/tinyshakespeare

$(DEMO_DATA)/train.manifest: data/corpus/tinyshakespeare.txt | build
	./$(BUILD)/spes-engine tokenize --input $< --out $(DEMO_DATA) --val-fraction 0.05

run: build $(DEMO_DATA)/train.manifest
	./$(BUILD)/spes-engine local configs/tiny.toml

bench: build
	@for b in $(BUILD)/bench_*; do echo "== $$b"; $$b || exit 1; done

clean:
	rm -rf $(BUILD)
