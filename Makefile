# The two commands a learner needs:  make lab   |   make test
# Everything lives in .venv at the repo root; every target puts .venv/bin first
# on PATH so %%bash cells, torchrun and nbval kernels use the same Python.

VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
NB_PY   := $(sort $(wildcard notebooks/[0-9][0-9]_*.py))

export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export OMP_NUM_THREADS ?= 1
export PYTHONWARNINGS ?= ignore::FutureWarning
export PYTHONNOUSERSITE := 1
export DEBIAN_FRONTEND := noninteractive

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
QUIET := 2>&1 | { grep -v "^WARNING: Location" || true; }


TORCH_INDEX ?=  # pip's index for torch alone; empty: pip's own (see below)

setup: $(STAMP)

# torch first, with pip, from its pin: pip's default index gives Linux the CUDA build (several GB with its NVIDIA
# packages); make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu installs the CPU-only build (a CUDA build
# you installed yourself on a GPU node is kept), then the rest without build isolation so the
# DeepSpeed sdist builds against that torch instead of downloading another. The rest goes in
# with uv, a pip-compatible installer (the same packages at the same versions as pip's: 23 s
# against 58 s on 2 cores); with pip if uv cannot (a private index only pip is told about, say).
# --compile-bytecode writes the .pyc files as pip does: where PYTHONDONTWRITEBYTECODE is set (as on
# CI's machines) nothing else writes them, and every job's ranks would compile transformers afresh.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "setuptools>=64" wheel uv $(QUIET)
	$(PY) -m pip install -q --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0 $(QUIET)
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) --no-build-isolation -e ".[dev]" || { \
		echo "setup: uv could not install the dependencies (above); pip instead"; \
		$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[dev]" $(QUIET); }
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@$(MAKE) --no-print-directory libaio
	$(PY) -m helpers.warmup
	touch $(STAMP)

# NVMe offload (notebook 13) needs libaio's header for DeepSpeed's async_io op. Installed here when
# we can (root with apt-get, as in CI); otherwise a note, and the NVMe parts are skipped, saying why.
libaio:
	@test -e /usr/include/libaio.h || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
		{ apt-get install -y -qq libaio-dev || { apt-get update -qq && apt-get install -y -qq libaio-dev; }; } \
		>/dev/null 2>&1 && echo "setup: installed libaio-dev"; } || \
		echo "setup: libaio-dev is not installed (needs root: sudo apt-get install libaio-dev);" \
		"NVMe offload will be skipped"

# JupyterLab on the working copy work/ (ignored by git; made on first use by helpers.workcopy): runs and
# autosaves never touch the repo's notebooks. On a remote machine: make lab LAB_IP=0.0.0.0 LAB_PORT=8888
# LAB_TOKEN=yours (or keep the default address and tunnel: ssh -L 8888:localhost:8888 user@host).
# --allow-root is added when run as root (containers, cloud workshop machines).
LAB_IP    ?= 127.0.0.1
LAB_PORT  ?= 8888
ifeq ($(origin LAB_TOKEN),undefined)
LAB_TOKEN := $(shell od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
endif
# Serving on every interface (0.0.0.0: IPv4; ::, IPv6 too), the URLs name this machine's addresses (hostname -I):
# laptops in a workshop room often cannot resolve its hostname, which is used only when it has no address.
LAB_ANY   := $(filter 0.0.0.0 ::,$(LAB_IP))
LAB_HOSTS := $(if $(LAB_ANY),$(foreach a,$(shell hostname -I 2>/dev/null),$(if $(findstring :,$(a)),$(if \
	$(filter ::,$(LAB_IP)),[$(a)]),$(a))),$(if $(findstring :,$(LAB_IP)),[$(LAB_IP)],$(LAB_IP)))
LAB_HOSTS := $(or $(LAB_HOSTS),$(shell hostname -f 2>/dev/null || hostname))
LAB_LOOPBACK := $(filter 127.0.0.1 localhost ::1,$(LAB_IP))
LAB_FIRST := lab/tree/notebooks/00_launching.ipynb

lab: setup
	$(PY) -m helpers.workcopy
	@echo "lab: serving work/ (your copies; make lab-refresh replaces them with the repo's)"
	@$(foreach h,$(LAB_HOSTS),echo "lab: open http://$(h):$(LAB_PORT)/$(LAB_FIRST)?token=$(LAB_TOKEN)";)
	@$(if $(LAB_LOOPBACK),echo "lab: from another machine: ssh -L $(LAB_PORT):localhost:$(LAB_PORT) USER@THIS_HOST," \
		"then open http://localhost:$(LAB_PORT)/$(LAB_FIRST)?token=$(LAB_TOKEN)",:)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=work --ip=$(LAB_IP) --port=$(LAB_PORT) \
		--ServerApp.port_retries=0 --IdentityProvider.token=$(LAB_TOKEN) \
		--LabApp.default_url=/$(LAB_FIRST) $(if $(filter 0,$(shell id -u)),--allow-root --no-browser)

# fresh copies of the repo's notebooks in work/ (your edited copies move to work/notebooks/previous/)
lab-refresh:
	$(PY) -m helpers.workcopy --refresh

test: setup lint test-unit test-notebooks

# Two test files at a time (pytest-xdist; one file's tests stay together, so its shared runs are made
# once): a job's ranks leave cores idle while they start and wait on each other. On a GPU node, where
# every nccl job takes all the GPUs it names, one at a time (detected with nvidia-smi; TEST_WORKERS=N overrides).
# On a CPU the test jobs' ranks are forked from a server that has imported torch (tests/zygote.py; the
# notebooks and the launcher's own tests use torchrun); GUIDE_TEST_LAUNCHER=torchrun uses torchrun for all.
TEST_WORKERS ?= $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo 1 || echo 2)
test-unit: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

# nbval executes every notebook; GUIDE_SIZE=quick runs the same cells with fewer steps. Two notebooks at a
# time (each one's cells in order on one worker; their runs go to their own notebooks/runs/NN_* dirs), the
# longest first (at quick size in CI, 08's walk cell alone took 4.7 min; the deep dives 12 and 17 hold the
# sweeps 02 and 07 had), so that no worker starts a long one while the other runs out of notebooks
# (xdist would order them by their number of cells). 01 goes early and 11 late: 11 copies 01's jobs when
# 01 has run them (--reuse), and runs its own otherwise (in CI, 201 s against 156 s for 01's).
NB_FIRST := $(foreach n,08 12 01 17 09 05,$(wildcard notebooks/$(n)_*.ipynb))
NB_TEST  := $(NB_FIRST) $(filter-out $(NB_FIRST),$(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb)))
test-notebooks: setup
	GUIDE_SIZE=quick $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=8 \
		--nbval-lax $(NB_TEST) -p no:cacheprovider

# JupyterLab in headless Chromium (Debian's chromium package): opens notebooks/00_launching.py
# through jupytext, runs every cell, checks for errors and a figure; screenshot in pytest's tmp dir
test-browser: setup
	@command -v chromium >/dev/null || { echo "error: test-browser needs chromium: apt-get install chromium" >&2; exit 2; }
	GUIDE_BROWSER_TEST=1 GUIDE_SIZE=quick $(PY) -m pytest -q -rP tests/browser -p no:cacheprovider

# .py (percent format) is the source. The notebooks whose outputs are stale (their code cells, helpers/ or
# launch_configs/ changed since the hash their .ipynb records; all of them with FORCE=1) are rebuilt from
# the .py and executed, the .py is written back in jupytext's canonical form (bash cells commented, so ruff
# can read it), and the outputs are tidied (whole lines, no widget state) and stamped with the tree's hash.
# A fresh notebook only gets the .py's markdown copied over: prose does not run. A notebook that reads the runs
# of one re-executed before it (10 reads 00's, 11 01's, 13 03's, 14 04's, 18 08's: `--reuse` copies) is re-executed
# too, so that the copies are the committed ones.
# a notebook's source reads the runs of notebook $$d (its run directories, or a walk's --reuse of them)
READS_RUNS_OF = runs/$${d}_|--reuse $${d}\b
notebooks: setup
	@test "$${GUIDE_SIZE:-full}" = full || { echo "error: GUIDE_SIZE=$$GUIDE_SIZE: make notebooks commits" \
		"full-size outputs; allowed: full (unset it)" >&2; exit 2; }
	@stale=" $$($(PY) -m helpers.nb.freshness stale | tr '\n' ' ') "; ran=""; \
	for f in $(NB_PY); do \
		reads=""; for d in $$ran; do grep -q -E "$(READS_RUNS_OF)" "$$f" && reads="$$reads $$d"; done; \
		case "$(if $(FORCE),$$f,$$stale)" in *"$$f"*) ;; *) if [ -z "$$reads" ]; then \
			$(PY) -m helpers.nb.freshness prose "$$f" && echo "== $$f: outputs fresh" && continue; exit 1; fi;; esac; \
		echo "== $$f$${reads:+ (it reads the runs of$$reads, re-executed above)}"; \
		$(VENV)/bin/jupytext --to ipynb --set-kernel python3 --execute "$$f" || exit 1; \
		$(VENV)/bin/jupytext --quiet --to py:percent "$${f%.py}.ipynb"; \
		$(PY) -m helpers.nb.freshness finish "$${f%.py}.ipynb"; \
		ran="$$ran $$(basename $$f | cut -c1-2)"; \
	done; \
	for d in $$ran; do for g in $$(grep -l -E "$(READS_RUNS_OF)" notebooks/[0-9][0-9]_*.py); do \
		case " $(NB_PY) " in *" $$g "*) ;; *) echo "note: $$g reads the runs of $$d, re-executed here: re-execute it" \
			"too (make notebooks FORCE=1 NB_PY=$$g)";; esac; done; done

# each notebook's words, cells and minutes to read and to run (from its committed outputs), and the totals
minutes: setup
	@$(PY) -m helpers.nb.freshness minutes

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf notebooks/runs runs .pytest_cache work/notebooks/runs
