# shardlb — the commands everyone uses. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install redis-server postgres wrk chromium screenshots run stop test lint format typecheck bench bench-scale bench-scaleout bench-load-steps bench-app bench-versus-reads bench-rebalance bench-dedup bench-archive bench-lua bench-rebuild bench-settle bench-reshard chaos k8s-check clean

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench]'
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install shardlb with its test and bench extras

postgres: ## make sure PostgreSQL's initdb/pg_ctl are here, unless SHARDLB_POSTGRES_URL is set
	@bash scripts/ensure-postgres.sh

redis-server: ## make sure redis-server >= 7 is on PATH (installs it with apt-get when root)
	@bash scripts/ensure-redis.sh

wrk: ## make sure Debian's wrk is on PATH for the bench's hot reads (bench/hot.py)
	@bash scripts/ensure-wrk.sh

chromium: ## make sure Debian's chromium is at /usr/bin/chromium for the dashboard's browser test
	@bash scripts/ensure-chromium.sh

run: install redis-server postgres ## start a local Redis Cluster, a private PostgreSQL, the archiver, a `demo` board and the router on :8000 (SHARDLB_PORT=N for another port; SHARDLB_CLUSTER_PORT=N for the cluster's ports when it is first formed)
	@bash scripts/dev-run.sh

stop: ## stop the router, the archiver, the local cluster and the private PostgreSQL that `make run` started
	@bash scripts/dev-stop.sh

# The suite mostly waits (on clusters, routers, subprocesses): worker processes overlap the waits.
# Each worker starts its own cluster and PostgreSQL (tests/conftest.py, ports from tests/ports.py);
# --dist loadscope keeps a module on one worker, so a module's own cluster or router starts once.
# Three on two cores: 383 s for 1,940 tests where two took 530-580 s (2026-12-05, README "Tests").
# PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 3
# Compiled bytecode is kept under .shardlb/pycache even where PYTHONDONTWRITEBYTECODE is set (CI and
# sandboxes set it): without it each pytest process rewrote and compiled the 160 test modules again
# (10 s of CPU a process, 2.7 s with the cache) and each of the hundreds of python processes the tests
# start (routers, CLI, bench) compiled shardlb/ and router/ again. The tree gets no __pycache__.
# A clean clone's first run (CI) fills the cache; its own workers still compile the test modules each.
TEST_BYTECODE := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/.shardlb/pycache

test: install redis-server postgres chromium ## run lint, type checks and the whole test suite (starts its own cluster)
	$(BIN)/ruff check shardlb router bench tests
	$(BIN)/ruff format --check shardlb router bench tests
	$(BIN)/mypy
	$(TEST_BYTECODE) $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadscope --durations=10

screenshots: install redis-server chromium ## run the dashboard's browser test and keep its screenshots in docs/img
	SHARDLB_SCREENSHOTS=docs/img $(BIN)/pytest -q tests/test_dashboard_browser.py

lint: install ## check style and types without changing anything
	$(BIN)/ruff check shardlb router bench tests
	$(BIN)/ruff format --check shardlb router bench tests
	$(BIN)/mypy

format: install ## fix style in place
	$(BIN)/ruff check --fix shardlb router bench tests
	$(BIN)/ruff format shardlb router bench tests

bench: install redis-server wrk ## ~13 min headless load test: write ramp and latency curve, read mixes, journal and archiver costs, hot reads; bench/results/<timestamp>/
	$(BIN)/python -m bench.run

bench-scale: install redis-server ## long: 10M players on 16 shards, memory and latency at 1M and 10M
	$(BIN)/python -m bench.scale

bench-scaleout: install redis-server ## ~2.5 min: raw writes/s and "my rank" reads/s on 1, 2, 3 masters, then reads from 1 and 2 replicas per master, nodes pinned to CPUs, Redis CPU per op (SHARDLB_SCALEOUT_*)
	$(BIN)/python -m bench.scaleout

bench-load-steps: install redis-server ## ~5 min: a router's and the store's CPU per score at 5,000 and 15,000 scores/s paced and back to back, beside the library's, on 3 and 16 shards; a write script call's fixed part (SHARDLB_STEPS_*)
	$(BIN)/python -m bench.load_steps

bench-rebalance: install redis-server ## ~1 min: a band board's drifted bands drawn again (shardlb bands --apply's reshard), each master's Redis CPU per "my rank" before and after (SHARDLB_REBALANCE_*)
	$(BIN)/python -m bench.rebalance

bench-dedup: install redis-server ## ~2 min: bytes per incr dedup record and the CPU of dedup buckets
	$(BIN)/python -m bench.dedup

bench-archive: install postgres ## ~1 min: PostgreSQL bytes per archived result (SHARDLB_ARCHIVE_RESULTS), for `shardlb plan`
	$(BIN)/python -m bench.archive_size

bench-app: install redis-server ## ~1 min: the router app's own CPU per score write and per "my rank", "around me" and friends read, no HTTP server (AGAINST=<git rev> to compare; INSTRUCTIONS=1 adds its instructions under callgrind, a proxy that repeats, ~1.5 min more a revision)
	$(BIN)/python -m bench.app_cost $(if $(AGAINST),--against $(AGAINST),) $(if $(INSTRUCTIONS),--instructions,)

bench-lua: install redis-server ## ~3 min: Redis instructions per score in write.lua under callgrind (AGAINST=<git rev> to compare)
	$(BIN)/python -m bench.lua_cost --full-window $(if $(AGAINST),--against $(AGAINST),)

# The other revision runs from a clone of this repository under .shardlb/ with its own .venv (its own
# dependencies, as it pinned them), kept for the next run of that revision; `make clean` removes it.
bench-versus-reads: install redis-server ## ~5 min at 1M players (+2 min the first time: the clone and its install): make bench's read mix on the one-shard-per-master board through this tree's router and AGAINST=<git rev>'s in turn (SHARDLB_BENCH_PLAYERS, ROUNDS=4)
	@[ -n "$(AGAINST)" ] || { echo "usage: make bench-versus-reads AGAINST=<git rev> [ROUNDS=4]"; exit 2; }
	rev=$$(git rev-parse --short "$(AGAINST)^{commit}") && dir=.shardlb/against-$$rev && \
	{ [ -d $$dir ] || git clone -q . $$dir; } && git -C $$dir checkout -q --detach $$rev && \
	$(MAKE) -C $$dir install && $(BIN)/python -m bench.versus_reads $$dir --rounds $(or $(ROUNDS),4)

bench-rebuild: install redis-server ## ~1 min: rebuild a 1M-player board from PostgreSQL (SHARDLB_REBUILD_PLAYERS)
	$(BIN)/python -m bench.rebuild

bench-reshard: install redis-server ## ~3 min: reshard a 1M-player board 16 -> 4 shards while writers post over HTTP (SHARDLB_RESHARD_PLAYERS)
	$(BIN)/python -m bench.reshard

bench-settle: install redis-server ## ~3 min: settle a 1M-player daily board, steps timed; killed after each step (SHARDLB_SETTLE_PLAYERS)
	$(BIN)/python -m bench.settle

chaos: install redis-server postgres ## ~8 min failover, slot-migration and reshard tests that count acknowledged writes; bench/results/chaos-<timestamp>/
	$(BIN)/python -m bench.chaos

k8s-check: install redis-server postgres ## offline checks of Dockerfile and k8s/ (render, validate, lint, pod scripts, archiver)
	$(BIN)/pytest -q tests/test_k8s_manifests.py tests/test_k8s_scripts.py

# As root the private PostgreSQL's data lives outside .shardlb (shardlb/postgres.py): destroy() finds it.
clean: stop ## remove the virtualenv and local state
	@[ ! -d .shardlb/postgres ] || $(BIN)/python -c 'from shardlb.postgres import LocalPostgres; LocalPostgres(".shardlb/postgres").destroy()'
	rm -rf $(VENV) .shardlb
