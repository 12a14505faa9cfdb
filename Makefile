# Stoker: `make run` runs the main job, `make test` the test suite. Both create .venv first.
# `make docs` builds the documentation site into site/ (strict); preview it with
# `.venv/bin/mkdocs serve` (http://127.0.0.1:8000).
# CPU machines get the CPU build of PyTorch (pinned) before anything else, so that the open
# `torch` requirement in pyproject.toml never pulls a multi-GB CUDA build. On a CPU machine
# outside a mirror that serves CPU wheels, point pip at PyTorch's CPU index:
#   make TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu run
# GPU machines (nvidia-smi present) skip this and install the CUDA build from the open range.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CPU_TORCH ?= torch==2.13.0
TORCH_INDEX_URL ?=
EXTRAS ?= dev,docker,kubernetes,s3
ARGS ?=
# The lock: exact versions of every dependency (the set the suite last passed with), used by every
# `make install`, so no resolver searches the open ranges of pyproject.toml (6.5 minutes of a
# silent pip on 2 idle cores). CONSTRAINTS= (empty) installs from the open ranges instead.
CONSTRAINTS ?= .ci/constraints.txt
# uv installs the locked set in parallel, with progress; pinned, and installed by pip into the venv.
# UV= (empty), or a uv that cannot be installed, falls back to pip with the same lock.
UV ?= uv==0.13.9
PIP := $(PY) -m pip install --disable-pip-version-check --progress-bar on
# --compile-bytecode: uv writes no .pyc by default, leaving it to the first import, and where
# PYTHONDONTWRITEBYTECODE is set (this project's CI machines; many container images) no import
# ever writes one: every process compiled MLflow, Prefect and the rest from source again
# (`stoker predict`: 9.9 CPU-s of which 5.5 compiling, about 6 with the .pyc files; pip compiles by
# default). Stoker's own modules are compiled after the install for the same reason.
UV_PIP := $(VENV)/bin/uv pip install --compile-bytecode --python $(PY)

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export MLFLOW_DISABLE_TELEMETRY ?= true
export DVC_NO_ANALYTICS ?= 1
export DO_NOT_TRACK ?= 1
export NO_MKDOCS_2_WARNING ?= 1

.PHONY: install run test lint docs clean constraints

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "no GPU driver found: installing the CPU build $(CPU_TORCH) (after any download, unpacking it takes about half a minute without output)"; \
	  $(PIP) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(CPU_TORCH)"; \
	fi
	@if [ -n "$(UV)" ] && $(PIP) --quiet "$(UV)"; then \
	  echo "installing Stoker and its locked dependencies with $(UV)$(if $(CONSTRAINTS), (lock: $(CONSTRAINTS)))"; \
	  echo "(once installed, their ~22,000 modules are compiled to bytecode: 20-45 s on 2 cores, without output until the end)"; \
	  $(UV_PIP) $(if $(CONSTRAINTS),--constraint $(CONSTRAINTS)) -e ".[$(EXTRAS)]"; \
	else \
	  echo "installing Stoker and its dependencies with pip$(if $(CONSTRAINTS), (lock: $(CONSTRAINTS)))"; \
	  $(PIP) $(if $(CONSTRAINTS),--constraint $(CONSTRAINTS)) -e ".[$(EXTRAS)]"; \
	fi
	$(PY) -m compileall -q stoker flows tasks >/dev/null
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/stoker run $(ARGS)

# Two pytest-xdist workers by default, one per core here (the suite is bound by CPU: three
# workers were no faster on 2 cores); the Docker tests share one worker (tests/conftest.py).
# TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install
	$(VENV)/bin/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

lint: install
	$(VENV)/bin/ruff check .

# Strict: a broken link, a page missing from the nav or an unresolved API object fails the build.
docs: install
	$(VENV)/bin/mkdocs build --strict

# Rewrite .ci/constraints.txt from this environment (after a dependency change and a green suite).
constraints: install
	{ sed -n '1,3p' .ci/constraints.txt; \
	  $(PY) -m pip freeze --exclude-editable --disable-pip-version-check \
	    | grep -viE '^(torch|stoker)([=@ ]|$$)'; } > .ci/constraints.txt.new
	mv .ci/constraints.txt.new .ci/constraints.txt

clean:
	rm -rf work .pytest_cache site
