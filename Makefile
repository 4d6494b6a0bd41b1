# moeflex: the two commands are `make train` and `make test`; each installs what is
# missing, builds, and prepares the default data first.
BUILD ?= build
JOBS ?= $(shell nproc)
ARGS ?=

.PHONY: all setup build data train test bench clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD)/CMakeCache.txt: | setup
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

build: setup $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

data: setup
	@bash scripts/prepare_corpus.sh

# The main job: the default model on the Brown corpus, on 2 ranks with expert
# parallelism, under a 250 MiB device budget where the adaptive planner is active
# (the progress bar shows the shares recomputed and offloaded; the summary its decisions). Run dir under runs/.
MPIRUN ?= mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1
train: build data
	$(MPIRUN) $(BUILD)/moeflex train --ep 2 --policy adaptive --device-memory 250MiB $(ARGS)

# The whole test suite (CTest + GoogleTest).
test: build data
	cd $(BUILD) && ctest --output-on-failure --timeout 1200 $(ARGS)

# moeflex vs the PyTorch reference on the same config, threads and batch.
bench: build data
	bash bench/run_bench.sh

clean:
	rm -rf $(BUILD)
