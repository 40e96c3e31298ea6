# One virtual environment for everything; every target bootstraps it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test processes side by side: the cluster tests mostly wait on real timers (leases, failover, engine
# steps), so four workers on two cores take about half the time of one (`make test TEST_WORKERS=0`: one).
TEST_WORKERS ?= 4

.PHONY: venv test demo lint proto proto-check bench bench-peers bench-overload helm image clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

## Run the whole test suite (unit, integration, cluster, chart). Fetches helm for the chart tests and,
## where podman exists, builds the image for the containerised chart demo (skipped without podman).
## The Prometheus checks need promtool and prometheus (Debian's prometheus package; .ci/run installs
## it): without them they skip with a message, except in CI where they fail.
test: $(STAMP)
	test -x $(BIN)/helm || command -v helm >/dev/null || bash scripts/get-helm.sh $(BIN)
	if command -v podman >/dev/null; then bash scripts/build-image.sh; \
	else echo "podman not found: the containerised chart demo will be skipped"; fi
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

## Run the local cluster demo (etcd, masters, agents, simulated engines).
demo: $(STAMP)
	$(BIN)/pdcoord demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## Regenerate the committed protobuf modules from proto/.
proto: $(STAMP)
	$(BIN)/python -m pdcoord.dev.protogen

## Fail when the committed generated modules differ from a fresh generation.
proto-check: $(STAMP)
	$(BIN)/python -m pdcoord.dev.protogen --check

## Rerun the benchmarks (results in bench/results/, summary in bench/README.md).
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python bench/admission_bench.py
	$(BIN)/python bench/admission_sim.py
	$(BIN)/python bench/handover_bench.py

## Benchmarks against peers: router overhead (direct / pdmaster / sglang-router), failover time,
## multi-master scaling (about 20 min; installs the bench extra and sglang-router's own venv).
bench-peers: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	$(BIN)/python bench/proxy_bench.py
	$(BIN)/python bench/failover_bench.py
	$(BIN)/python bench/scale_bench.py

## What bounded admission is worth under overload: model-mode engines behind sglang-router (as
## shipped, tuned, side by side) and pdcoord (1, 2, 4 masters), a load sweep and a burst (about 75 min).
bench-overload: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	$(BIN)/python bench/overload_bench.py --calibrate

## Fetch helm (for the chart tests) into the virtual environment.
helm: $(STAMP)
	bash scripts/get-helm.sh $(BIN)

## Build the container image and tag it as the chart's default image (docker, podman or buildah).
image:
	bash scripts/build-image.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
