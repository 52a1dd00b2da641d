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
.PHONY: help setup lab formgrader system-packages test test-quick benchmark student validate clean release collect autograde feedback grades

help: ## list the targets
	@echo "Targets:"
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

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

# JupyterLab's settings ship in jupyter-config/ (its README says what each file does): the lab opens on the
# rendered index with no news pop-up; learners get no nbgrader instructor tools (jupyter-config/learner/),
# instructors get them with make formgrader. The server picks a free port and prints the link to open.
LAB = $(abspath $(VENV))/bin/jupyter lab $(ROOT_ARGS) $(LAB_ARGS)

lab: setup ## open the course in JupyterLab (the URL is printed below)
	@echo "Starting JupyterLab on notebooks/: open the http://localhost:<port>/lab/tree/README.md?token=... link it prints below."
	cd notebooks && JUPYTER_CONFIG_PATH="$(CURDIR)/jupyter-config/learner:$(CURDIR)/jupyter-config" $(LAB)

# On the whole repository (nbgrader_config.py), with the references importable as when grading: instructors only.
formgrader: setup ## instructors: JupyterLab with nbgrader's Formgrader and Create Assignment tools
	@echo "Starting JupyterLab on the repository, with nbgrader's tools: open the link it prints below."
	JUPYTER_CONFIG_PATH="$(CURDIR)/jupyter-config" PYTHONPATH="$(CURDIR)/autograder" \
		PATH="$(abspath $(VENV))/bin:$$PATH" $(LAB)

# nbval re-runs every solution notebook and compares its outputs (hidden tests import grading and the
# references from autograder/: there they run in trusted mode, each check comparing the solution with its reference).
NBVAL = $(GRADING_ENV) $(PY) -m pytest -q -p no:cacheprovider --basetemp=.pytest-nbval --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg solutions

# The grading sandbox (bwrap) and the browser test (chromium) need Debian packages. Without them the tests
# would fail (tests/conftest.py), so make test checks first: it installs them where it may (root, or sudo
# without a password) and otherwise stops at once with the command to run. ALLOW_SKIP=1 (developers only)
# skips the sandbox and browser tests instead; the run is then not a full test.
DEB_PACKAGES = bubblewrap chromium chromium-driver
CHROMIUM = /usr/bin/chromium
APT_INSTALL = apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $(DEB_PACKAGES)

system-packages: ## install what make test needs from Debian (bubblewrap, chromium), or say how
	@if command -v bwrap >/dev/null && [ -x $(CHROMIUM) ]; then exit 0; fi; \
	if [ -n "$(filter-out 0,$(ALLOW_SKIP))" ]; then echo "ALLOW_SKIP=$(ALLOW_SKIP): no bwrap or $(CHROMIUM) here, their tests are skipped"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then echo "Installing $(DEB_PACKAGES)"; sh -c '$(APT_INSTALL)'; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then echo "Installing $(DEB_PACKAGES) with sudo"; sudo sh -c '$(APT_INSTALL)'; \
	else echo "make test needs bubblewrap (the grading sandbox) and Debian's chromium (the browser test). Run:" >&2; \
		echo "  sudo sh -c '$(APT_INSTALL)'" >&2; \
		echo "then make test again (or ALLOW_SKIP=1 make test to skip those tests)." >&2; exit 1; fi

# make test runs three streams at once, each mostly waiting for processes it started (kernels, torchrun ranks,
# chromium), so that together they keep both cores of a small machine busy: the browser walk, then nbval, then the
# files written with PyTorch's test harness; the grading pipeline's sandboxed tests; and the other tests, whose output
# shows as they run. The two in the background write to $(WALK_LOG) and $(GRADING_LOG), printed after; make test
# fails if any part fails. Each pytest has its own --basetemp and no cache, so that none cleans up or overwrites
# another's files. The streams are balanced by time: alone, the other tests would run 2 minutes past the rest.
WALK_LOG = .walk-test.log
GRADING_LOG = .grading-test.log
SANDBOXED = tests/test_grading.py tests/test_round_trip.py tests/test_sandbox.py
WALK_THEN = tests/test_pytorch_harness.py
BACKGROUND_PYTEST = $(PY) -m pytest -q -p no:cacheprovider

# OpenMP's threads (torch's intra-op pool) otherwise spin after every parallel region, waiting for the next: in
# every kernel, rank and program the tests start. That burnt a third of a notebook's CPU time, taken from the
# streams running beside it. Sleeping instead changes no result.
test: export OMP_WAIT_POLICY = PASSIVE
test: system-packages setup ## run the tests: unit tests, notebooks through nbgrader, a browser, and nbval
	@{ $(BACKGROUND_PYTEST) --basetemp=.pytest-browser tests/test_browser.py; browser=$$?; \
	  echo '$(NBVAL)'; $(NBVAL); nbval=$$?; \
	  $(BACKGROUND_PYTEST) --basetemp=.pytest-harness $(WALK_THEN); harness=$$?; \
	  [ $$browser -eq 0 ] && [ $$nbval -eq 0 ] && [ $$harness -eq 0 ]; } >$(WALK_LOG) 2>&1 & \
	walk=$$!; \
	$(BACKGROUND_PYTEST) --basetemp=.pytest-grading $(SANDBOXED) >$(GRADING_LOG) 2>&1 & \
	graded=$$!; \
	echo "$(PY) -m pytest -q --ignore=tests/test_browser.py $(SANDBOXED:%=--ignore=%) $(WALK_THEN:%=--ignore=%)"; \
	echo "   (beside it: tests/test_browser.py, then nbval, then $(WALK_THEN), in $(WALK_LOG); $(SANDBOXED) in $(GRADING_LOG))"; \
	$(PY) -m pytest -q --ignore=tests/test_browser.py $(SANDBOXED:%=--ignore=%) $(WALK_THEN:%=--ignore=%); rest=$$?; \
	wait $$graded; grading=$$?; \
	echo "== $(SANDBOXED)"; cat $(GRADING_LOG); \
	wait $$walk; walked=$$?; \
	echo "== tests/test_browser.py, then nbval, then $(WALK_THEN)"; cat $(WALK_LOG); \
	[ $$rest -eq 0 ] && [ $$grading -eq 0 ] && [ $$walked -eq 0 ]

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
