# Multi-GPU PyTorch course. GNU make; needs only python3 (>= 3.11), no conda.
#   make lab    set everything up and open the course in JupyterLab
#   make test   run the tests

VENV ?= .venv
PY = $(VENV)/bin/python
PIP = $(PY) -m pip
STAMP = $(VENV)/.installed
# Exactly this torch: pip.conf points at a local CPU wheel; anything newer is a multi-GB CUDA download.
TORCH = torch==2.13.0
LAB_ARGS ?=
# Jupyter refuses to start as root (containers, CI boxes) unless told to.
ROOT_ARGS = $(if $(filter 0,$(shell id -u)),--allow-root)

.DEFAULT_GOAL := help
.PHONY: help setup lab test test-quick benchmark student validate clean release collect autograde feedback grades

help: ## list the targets
	@echo "Targets:"
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'

$(PY):
	python3 -m venv $(VENV)

# Reinstalls only when pyproject.toml (the dependency list) or the start-up hook changes. The hook,
# course_emulate.pth, lets worker processes of an emulated program (mp.spawn, torchrun) emulate too.
$(STAMP): pyproject.toml course/autostart.py | $(PY)
	$(PIP) install $(TORCH)
	$(PIP) install -e ".[test]" $(TORCH)
	$(PY) -c "import sysconfig, course.autostart as a; print('installed', a.install_pth(sysconfig.get_paths()['purelib']))"
	@touch $@

setup: $(STAMP) ## create .venv and install the course with all dependencies

lab: setup ## open the course in JupyterLab (the URL is printed below)
	@echo "Starting JupyterLab on notebooks/; open the http://localhost:8888/lab?token=... URL printed below."
	cd notebooks && ../$(VENV)/bin/jupyter lab README.md $(ROOT_ARGS) $(LAB_ARGS)

# nbval re-runs every solution notebook and compares its outputs (hidden tests import grading and the
# references from autograder/: there they run in trusted mode, each check comparing the solution with its reference).
NBVAL = $(GRADING_ENV) $(PY) -m pytest -q --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg solutions

test: setup ## run the tests: unit tests, notebooks through nbgrader, a browser, and nbval
	$(PY) -m pytest -q
	$(NBVAL)

test-quick: setup ## the emulator's unit tests only (no notebooks, browser or processes), stop at the first failure
	$(PY) -m pytest -q -x -m "not slow" --ignore=tests/test_notebooks.py --ignore=tests/test_browser.py \
		--ignore=tests/test_ddp.py --ignore=tests/test_ranks.py

benchmark: setup ## run every benchmarks/*.py
	@set -e; found=; for f in benchmarks/*.py; do \
		[ -e "$$f" ] || continue; found=1; \
		echo "== $$f"; $(PY) "$$f"; \
	done; [ -n "$$found" ] || echo "no benchmarks/*.py yet"

# nbgrader reads nbgrader_config.py: solutions/<chapter>/ (instructor source) -> notebooks/<chapter>/.
NBGRADER = PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/nbgrader
# Hidden tests import the reference implementations from autograder/references: on the path only
# when grading or validating, never in the learners' JupyterLab.
GRADING_ENV = PYTHONPATH="$(CURDIR)/autograder" MPLBACKEND=Agg
CHAPTERS = $(notdir $(patsubst %/,%,$(wildcard solutions/*/)))

student: setup ## generate the student notebooks/ from solutions/ (nbgrader generate_assignment, in one process)
	$(PIPELINE) release

validate: setup ## hidden tests pass on every solution and record what they expect; untouched student notebooks fail
	$(PIPELINE) selfcheck
	@set -e; for a in $(CHAPTERS); do \
		echo "== $$a"; \
		$(GRADING_ENV) $(NBGRADER) validate --invert notebooks/$$a/$$a.ipynb; \
	done

# Grading a workshop (autograder/README.md): release -> collect -> autograde -> feedback -> grades.
PIPELINE = PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m autograder.pipeline
JOBS ?= 2
ZIP ?=

release: setup ## student notebooks in notebooks/ and autograder/release.zip for an LMS
	$(PIPELINE) release

collect: setup ## unpack an LMS export: make collect ZIP=path/to/export.zip
	@test -n "$(ZIP)" || { echo "usage: make collect ZIP=path/to/export.zip"; exit 2; }
	$(PIPELINE) collect "$(ZIP)"

autograde: setup ## grade new/changed submissions, sandboxed, JOBS=2 at a time (UNSAFE_NO_SANDBOX=1 opts out)
	$(PIPELINE) autograde --jobs $(JOBS) $(if $(UNSAFE_NO_SANDBOX),--no-sandbox)

feedback: setup ## feedback HTML per student in autograder/feedback/ (hidden tests removed)
	$(PIPELINE) feedback

grades: setup ## autograder/grades.csv: score, max score and status per student and assignment
	$(PIPELINE) grades

clean: ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache *.egg-info build
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
	find . -name .ipynb_checkpoints -type d -prune -not -path './.git/*' -exec rm -rf {} +
