# Benchmarks (bench/README.md) and the reliability tests. Included by the top-level Makefile.
# Targets: bench, bench-quick, bench-vllm, bench-report, test-reliability.
#
#   bench          every benchmark in the main .venv, then the plots and docs/benchmarks.md
#   bench-quick    the same with --quick (a few minutes on 2 cores)
#   bench-vllm     prismgate's vLLM engine against `vllm serve` (needs .venv-vllm: make vllm-venv)
#   bench-report   redraw bench/results/*.png and docs/benchmarks.md from bench/results/*.json
#
# matplotlib (plots only) is a bench dependency: installed into .venv on first use.

BENCH_ENV := OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
BENCH_ARGS ?=
BENCH_MPL_STAMP := $(VENV)/.prismgate-bench-tools

.PHONY: bench bench-quick bench-vllm bench-report test-reliability

$(BENCH_MPL_STAMP): mk/bench.mk | $(STAMP)
	$(BIN)/pip install -q 'matplotlib>=3.9'
	touch $@

bench: $(STAMP) $(BENCH_MPL_STAMP)
	$(BENCH_ENV) $(BIN)/python -m bench.overhead $(BENCH_ARGS)
	$(BENCH_ENV) $(BIN)/python -m bench.sessions $(BENCH_ARGS)
	$(BENCH_ENV) $(BIN)/python -m bench.readouts $(BENCH_ARGS)
	$(BIN)/python -m bench.report

bench-quick:
	$(MAKE) bench BENCH_ARGS=--quick

bench-vllm: $(VLLM_STAMP)
	$(VLLM_TEST_ENV) $(VLLM_VENV)/bin/python bench/vs_vllm.py $(BENCH_ARGS)

bench-report: $(BENCH_MPL_STAMP)
	$(BIN)/python -m bench.report

test-reliability: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -p no:cacheprovider tests/reliability
