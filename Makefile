# TierFS build. Every target installs what it needs (apt-get for system
# packages, .venv for Python ones); nothing relies on the machine's state.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DATA   ?= ./.tierfs
PYTEST_ARGS ?=
# make test runs the core suite on this many pytest-xdist workers, one test
# file per worker at a time (--dist loadfile: a file's module-scoped cluster
# stays in one process). Most tests wait on daemons, so 2 workers on 2 cores
# halve the wall time (docs/testing.md); TEST_WORKERS=0 runs it in-process.
TEST_WORKERS ?= 2
# Python may write its bytecode caches (__pycache__, git-ignored). Images and
# CI machines often set PYTHONDONTWRITEBYTECODE=1; then every daemon, CLI call
# and worker the suite starts (about a thousand) compiled the whole package
# from source again: 0.15-0.33 s of CPU each (docs/testing.md).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install system proto proto-check lint test run bench bench-deps bench-engines bench-training soak clean down engines

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install-system.sh
	bash scripts/install-system.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

system:
	bash scripts/install-system.sh

proto: install
	$(BIN)/python scripts/gen_proto.py

proto-check: install
	$(BIN)/python scripts/gen_proto.py --check

lint: install
	$(BIN)/ruff check tierfs tests bench scripts
	$(BIN)/mypy

# The inference engines (vLLM, LMCache, SGLang) and CPU torch 2.13.0 in their
# own venv: the engines' declared dependencies pull CUDA builds, so the engines
# install with --no-deps (deploy/engines/engines.txt) and their dependencies
# from an explicit list (requirements.txt), every version pinned by
# constraints.txt; scripts/check_engines_venv.py then refuses a CUDA torch,
# torchvision/torchaudio/torchcodec or triton. One venv holds all three: their
# pins clash only on packages they do not use on CPU (docs/engines.md).
# The first build took about 3 minutes here (pip's cache warm; 2.8 GB); the stamp caches it.
ENGINES_VENV  := .venv-engines
EBIN          := $(ENGINES_VENV)/bin
ENGINES_STAMP := $(ENGINES_VENV)/.installed

engines: $(ENGINES_STAMP)

$(ENGINES_STAMP): $(STAMP) deploy/engines/requirements.txt deploy/engines/engines.txt deploy/engines/constraints.txt
	test -x $(EBIN)/python || $(PYTHON) -m venv $(ENGINES_VENV)
	$(EBIN)/python -m pip install -q --disable-pip-version-check \
		-r deploy/engines/requirements.txt -c deploy/engines/constraints.txt
	$(EBIN)/python -m pip install -q --disable-pip-version-check --no-deps -r deploy/engines/engines.txt
	$(EBIN)/python -m pip install -q --disable-pip-version-check --no-deps -e .
	$(EBIN)/python scripts/check_engines_venv.py
	touch $@

# Tests marked slow (the 200k-entry namespace growth) run in make soak. Then
# tests/engines, in the engines venv: the real engines against a real cluster.
test: install lint proto-check engines
	$(BIN)/python -m pytest -m "not slow" --ignore=tests/engines --durations=25 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(EBIN)/python -m pytest tests/engines --durations=15 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

run: install
	$(BIN)/python -m tierfs.demo --data $(DATA)

down: install
	$(BIN)/tierfs down --data $(DATA)

# The KV benchmark's peers (bench/bench_kv.py): Debian's redis-server, and
# Redis' and Mooncake Store's Python clients in their own venv (pinned by
# bench/constraints-kv.txt); TierFS stays in .venv. make test needs none of it.
BENCH_VENV  := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

bench-deps: .stamp-bench-system $(BENCH_STAMP)

# libibverbs1: Mooncake's binaries link it even when they only speak TCP.
.stamp-bench-system:
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server libibverbs1
	touch $@

$(BENCH_STAMP): bench/requirements-kv.txt bench/constraints-kv.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --disable-pip-version-check \
		-r bench/requirements-kv.txt -c bench/constraints-kv.txt
	touch $@

bench: install bench-deps bench-engines bench-training
	$(BIN)/python -m bench.run

# The engine adapters' benchmarks (bench/engines_*.py), in the engines venv:
# each loads a 4,096-token 8B-layout prefix through TierFS and through the
# alternative users have today (LMCache's Redis backend, SGLang's mooncake
# backend, vLLM's CPU tier alone); results in bench/results/engines_*.
ENGINES_BENCH_STAMP := $(ENGINES_VENV)/.bench-installed

$(ENGINES_BENCH_STAMP): $(ENGINES_STAMP) deploy/engines/bench.txt
	$(EBIN)/python -m pip install -q --disable-pip-version-check --no-deps -r deploy/engines/bench.txt
	touch $@

bench-engines: .stamp-bench-system $(ENGINES_BENCH_STAMP)
	$(EBIN)/python -m bench.engines_vllm
	$(EBIN)/python -m bench.engines_sglang
	$(EBIN)/python -m bench.engines_lmcache

# The training benchmarks that need torch, in the engines venv: a ~1 GiB
# safetensors load and a ~1 GiB DCP save/load with 4 ranks, each against the
# local disk; results in bench/results/training_*. The checkpoint burst and
# weights fan-out (bench/bench_training.py) run in make bench's bench.run.
bench-training: $(ENGINES_STAMP)
	$(EBIN)/python -m bench.training_safetensors
	$(EBIN)/python -m bench.training_dcp

# The randomized fault soak for 10 minutes (make test runs it for 30 s), then
# the model-based checker's random walks for 10 minutes (make test runs a
# fixed set of seeds: tests/checker), the KV checker's walks for 5
# minutes (tests/checker/kv_walk.py; TIERFS_KV_CHECKER_SEEDS for given seeds),
# and the metadata checker's for 5 minutes (tests/checker/meta_walk.py;
# TIERFS_META_CHECKER_SEEDS).
# TIERFS_CHECKER_SEEDS=1,2,3 runs those seeds instead; TIERFS_CHECKER_STEPS
# sets the length of each walk. Then the
# tests marked slow: the namespace grown to 200k entries through snapshots,
# and the glob edge cases of fsspec's Get and Put suites (tests/integrations).
soak: install
	TIERFS_SOAK_SECONDS=$${TIERFS_SOAK_SECONDS:-600} \
	TIERFS_CHECKER_SECONDS=$${TIERFS_CHECKER_SECONDS:-600} \
	TIERFS_KV_CHECKER_SECONDS=$${TIERFS_KV_CHECKER_SECONDS:-300} \
	TIERFS_META_CHECKER_SECONDS=$${TIERFS_META_CHECKER_SECONDS:-300} \
	$(BIN)/python -m pytest tests/soak -q -s
	$(BIN)/python -m pytest -m slow -q -s tests/meta tests/integrations

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(ENGINES_VENV) .stamp-bench-system .mypy_cache .ruff_cache .pytest_cache .hypothesis
