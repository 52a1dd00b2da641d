"""Tests that need something from the system say so with a mark, and fail where it is missing.

`@pytest.mark.needs("sandbox")` (the bubblewrap grading sandbox) and `@pytest.mark.needs("browser")`
(Debian's chromium, driven by playwright): a skip would leave `make test` green with grading and the
browser untested, so a missing one is a failure that says what to install. ALLOW_SKIP=1 turns these
failures into skips, for a developer who knows the run is not a full test.

`expected_results`: the grading pipeline's cache of expected results, shared by the throw-away courses of a session.
"""
import functools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
INSTALL = ("sudo sh -c 'apt-get update && apt-get install -y bubblewrap chromium chromium-driver' "
           "(make test does it itself as root or with passwordless sudo)")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(what): needs the grading 'sandbox' or the 'browser'; "
                                       "fails without it unless ALLOW_SKIP=1")


@functools.cache
def problem(what: str) -> str | None:
    """Why `what` cannot be used here, or None."""
    if what == "sandbox":
        sys.path.insert(0, str(ROOT))
        from autograder.pipeline import sandbox
        return sandbox.problem()
    if what == "browser":
        if not Path(CHROMIUM).exists():
            return f"Debian's chromium is not installed ({CHROMIUM})"
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            return "playwright is not installed (make setup installs it)"
        return None
    raise ValueError(f"unknown requirement {what!r}")


@pytest.fixture(scope="session")
def expected_results(tmp_path_factory):
    """One autograder/expected/ for every throw-away course the session grades (each links it in): a chapter's
    expected results (its solution run in trusted mode, ~15 s) are computed by the first course that grades it
    and read back by the next from the pipeline's own cache, valid while the solution, the references, grading.py
    and course/ are unchanged (autograder/pipeline/expected.py). Beside the courses, hidden from the sandbox
    as they are."""
    return tmp_path_factory.mktemp("expected")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        why = problem(*mark.args)
        if why is None:
            continue
        if os.environ.get("ALLOW_SKIP", "0") != "0":
            pytest.skip(f"no {mark.args[0]} here (ALLOW_SKIP is set): {why}")
        pytest.fail(f"no {mark.args[0]} here: {why}. The Debian packages: {INSTALL}; "
                    f"ALLOW_SKIP=1 skips these tests instead.", pytrace=False)
