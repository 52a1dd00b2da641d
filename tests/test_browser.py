"""The course in a real browser: JupyterLab on localhost, driven by Playwright with Debian's Chromium.

- Every chapter's student notebook, Run All as a learner does it: untouched (only the exercise cells and
  their tests, tagged raises-exception, may fail; every other cell runs, with its plots and widgets), then
  answered (the solution's code in each answer cell: no error at all, and moving a what-if slider redraws
  the figure). The answered notebook, saved, closed and reopened, shows its widgets again (the course's lab
  settings save widget state). The cells are told apart by their nbgrader metadata and tags, not by content.
- The checks themselves, on a small notebook that breaks each rule once: JupyterLab 4.6 renders an error
  output with the stderr mime type, as it renders a warning, so a traceback is told by its text.
- `make lab` lands on the rendered index (links to the chapters that open them), with no news pop-up
  and none of nbgrader's instructor tools, at the URL it prints.

Screenshots are written on failure. Without chromium these tests fail, or skip with ALLOW_SKIP=1
(tests/conftest.py).
"""
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

try:
    from playwright import sync_api as playwright
except ImportError:  # the needs("browser") mark reports it
    playwright = None

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())

pytestmark = pytest.mark.needs("browser")

# JupyterLab 4 renders an error output as application/vnd.jupyter.stderr, like a warning or a print to
# sys.stderr: a traceback is told apart by its text, "Traceback (most recent call last)" (IPython prints
# it for every raised exception) or a line starting with the exception's name (SyntaxError has no traceback).
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^[\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)", re.M)
# What course.lessons.exercises.demo_needs prints in place of a demo whose exercise is not done yet.
DEMO_WAITS = re.compile(r"to see this\.$", re.M)

# What the page shows of each cell, in notebook order: its prompt, the text of its stderr outputs, whether
# each image has loaded, how many outputs hold a rendered widget, and all its output text.
_SHOWN = """() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].map(cell => {
  const outputs = [...cell.querySelectorAll('.jp-OutputArea-output')];
  return {
    prompt: cell.querySelector('.jp-InputPrompt')?.textContent ?? '',
    stderr: outputs.filter(o => ['application/vnd.jupyter.stderr', 'application/vnd.jupyter.error']
                                .includes(o.dataset.mimeType)).map(o => o.textContent),
    images: [...cell.querySelectorAll('.jp-OutputArea-output img')].map(img => img.complete && img.naturalWidth > 0),
    widgets: outputs.filter(o => o.querySelector('.jupyter-widgets') !== null).length,
    text: outputs.map(o => o.textContent).join('\\n'),
  };
})"""
# Whether Run All is still going: cells queued ([*]) or the notebook's execution indicator busy.
_RUNNING = """() => ({
  queued: [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
          .filter(p => p.textContent.includes('*')).length,
  status: document.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status,
})"""


@dataclasses.dataclass
class Lab:
    """A JupyterLab server serving `folder`."""
    url: str
    token: str
    folder: Path

    def home(self) -> str:
        """The lab in a workspace of its own, emptied (reset), so it reopens no tab from an earlier run."""
        return f"{self.url}/lab/workspaces/browser-test?reset&token={self.token}"

    def shut_down_kernels(self):
        api = f"{self.url}/api/kernels"
        for kernel in json.load(urllib.request.urlopen(f"{api}?token={self.token}", timeout=10)):
            urllib.request.urlopen(urllib.request.Request(f"{api}/{kernel['id']}?token={self.token}",
                                                          method="DELETE"), timeout=30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab server for the module, with the learner's settings as `make lab` has them (and no one's
    own ~/.jupyter), on a free localhost port, serving a scratch folder; stopped afterwards."""
    folder = tmp_path_factory.mktemp("lab")
    port, token = _free_port(), "course-browser-test"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MPLBACKEND")}
    env["JUPYTER_CONFIG_PATH"] = f"{ROOT / 'jupyter-config' / 'learner'}{os.pathsep}{ROOT / 'jupyter-config'}"
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR", "JUPYTER_RUNTIME_DIR"):
        env[name] = str(tmp_path_factory.mktemp(name.lower()))
    log = tmp_path_factory.mktemp("log") / "jupyterlab.log"
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}", "--allow-root"]
    with open(log, "w") as stderr:
        server = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail("JupyterLab did not start: " + log.read_text()[-2000:])
    lab = Lab(url, token, folder)
    yield lab
    with contextlib.suppress(OSError):
        lab.shut_down_kernels()
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, started once for the module."""
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        yield chromium
        chromium.close()


@contextlib.contextmanager
def _page(browser, screenshot: Path):
    """A fresh page (no cookies or storage from another); a screenshot of it at `screenshot` if the test fails."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        yield page
    except BaseException:
        page.screenshot(path=str(screenshot), full_page=True)
        print(f"screenshot: {screenshot}")
        raise
    finally:
        context.close()


@pytest.fixture(scope="module")
def lab_page(lab, browser):
    """One JupyterLab page for the module's walks: loading the lab costs more browser time than a chapter's
    cells, so notebooks are opened and closed in it as a learner does (File menu)."""
    with _page(browser, lab.folder / "lab_page.png") as page:
        page.goto(lab.home(), timeout=90_000)
        page.wait_for_selector(".jp-LabShell", timeout=90_000)
        yield page


@contextlib.contextmanager
def _reported(page, lab: Lab, screenshot: Path):
    """On a failure: a screenshot at `screenshot`, then the lab reloaded with no notebook or kernel left, so
    the next test starts clean."""
    try:
        yield
    except BaseException:
        page.screenshot(path=str(screenshot), full_page=True)
        print(f"screenshot: {screenshot}")
        with contextlib.suppress(Exception):
            lab.shut_down_kernels()
            page.goto(lab.home(), timeout=90_000)
            page.wait_for_selector(".jp-LabShell", timeout=90_000)
        raise


@dataclasses.dataclass
class Walk:
    """A notebook after Run All in JupyterLab: as saved, and as the page shows each cell (see _SHOWN)."""
    saved: dict
    shown: list[dict]

    def ran(self, index: int) -> bool:
        return re.search(r"\[\d+\]", self.shown[index]["prompt"]) is not None

    def tracebacks(self, index: int) -> list[str]:
        return [text for text in self.shown[index]["stderr"] if TRACEBACK.search(text)]

    def plotted(self) -> set[int]:
        return {index for index, cell in enumerate(self.shown) if any(cell["images"])}


def _menu(page, menu: str, item: str):
    page.locator("li.lm-MenuBar-item", has_text=menu).first.click()
    page.locator(".lm-Menu-item", has_text=item).first.click()


def _open(page, lab: Lab, notebook: Path):
    """Open a notebook (File, Open from Path) and wait until its kernel is idle: before that, a Run All is lost."""
    _menu(page, "File", "Open from Path")
    page.locator(".jp-Dialog input").fill(notebook.relative_to(lab.folder).as_posix())
    page.keyboard.press("Enter")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_function("() => /\\| Idle/.test(document.querySelector('.jp-StatusBar-Widget')?.textContent)",
                           timeout=90_000)


def _close(page):
    """Close the notebook and shut its kernel down (File, Close and Shut Down), accepting the dialogs."""
    _menu(page, "File", "Close and Shut Down")
    notebook, dialog = page.locator(".jp-Notebook"), page.locator(".jp-Dialog .jp-mod-accept")
    deadline = time.time() + 30
    while notebook.count():
        assert time.time() < deadline, "the notebook did not close"
        if dialog.count():
            dialog.first.click()
        page.wait_for_timeout(200)


def _save(page, notebook: Path, timeout_s: float = 60) -> dict:
    """Save the open notebook (Ctrl+S) and return it as written."""
    saved_before, deadline = notebook.stat().st_mtime_ns, time.time() + timeout_s
    page.keyboard.press("Control+s")
    while True:  # the server may write the file in place: wait until it is new and whole
        assert time.time() < deadline, f"{notebook.name} was not saved"
        page.wait_for_timeout(200)
        if notebook.stat().st_mtime_ns != saved_before:
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(notebook.read_text())


def _widgets_without_state(saved: dict) -> list[str]:
    """The widget outputs of a saved notebook whose model the notebook's widget state lacks: reopened, each
    would show "model not found"."""
    state = saved["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    shown = [output["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
             for cell in saved["cells"] for output in cell.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in output.get("data", {})]
    return [model for model in shown if model not in state.get("state", {})]


def _walk(lab: Lab, page, notebook: Path, timeout_s: float = 300) -> Walk:
    """Open `notebook` in JupyterLab, Run All, wait until it stops (at the end, or at an error in a cell not
    tagged raises-exception), save it and read what each cell shows. The notebook stays open."""
    _open(page, lab, notebook)
    _menu(page, "Run", "Run All Cells")
    # Run All marks every cell queued at once and the indicator stays busy until the last cell is done, even
    # while JupyterLab resubmits the cells after a tagged cell's error: done is no cell queued and idle, for
    # three polls in a row.
    deadline, idle_polls = time.time() + timeout_s, 0
    while idle_polls < 3:
        assert time.time() < deadline, f"Run All of {notebook.name} did not stop within {timeout_s:.0f} s"
        page.wait_for_timeout(250)
        state = page.evaluate(_RUNNING)
        idle_polls = idle_polls + 1 if state["queued"] == 0 and state["status"] == "idle" else 0
    saved = _save(page, notebook)
    # Images decode after they are attached (a broken one never gets a width), and widgets may still be
    # loading their models; one that is still loading after a while never shows.
    page.wait_for_function("() => [...document.querySelectorAll('.jp-OutputArea-output img')].every(i => i.complete)",
                           timeout=30_000)
    with contextlib.suppress(playwright.TimeoutError):
        page.wait_for_function("() => !document.querySelector('.jp-Notebook').textContent.includes('Loading widget')",
                               timeout=10_000)
    return Walk(saved, page.evaluate(_SHOWN))


def _where(walk: Walk, index: int) -> str:
    lines = "".join(walk.saved["cells"][index]["source"]).strip().splitlines()
    return f"cell {index} ({lines[0][:70] if lines else 'empty'})"


def _problems(walk: Walk, may_fail: set[int]) -> list[str]:
    """What is wrong with a Run All: a code cell that did not run, a traceback outside `may_fail`, an error
    output the page does not show as a traceback, a plot that did not render, a widget that did not render."""
    cells = walk.saved["cells"]
    if len(cells) != len(walk.shown):
        return [f"the page shows {len(walk.shown)} cells, the notebook has {len(cells)}"]
    problems = []
    for index, (cell, shown) in enumerate(zip(cells, walk.shown)):
        if cell["cell_type"] != "code":
            continue
        where = _where(walk, index)
        if not walk.ran(index):
            problems.append(f"{where} did not run (prompt {shown['prompt']!r})")
            continue
        tracebacks = walk.tracebacks(index)
        if tracebacks and index not in may_fail:
            problems.append(f"{where} failed:\n{tracebacks[0][-2000:]}")
        if any(output["output_type"] == "error" for output in cell["outputs"]) and not tracebacks:
            problems.append(f"{where}: the kernel sent an error the page does not show as a traceback")
        images = sum("image/png" in output.get("data", {}) for output in cell["outputs"])
        if not all(shown["images"]) or sum(shown["images"]) < images:
            problems.append(f"{where}: {images} plot(s) sent, {sum(shown['images'])} rendered, "
                            f"{shown['images'].count(False)} broken")
        widgets = sum("application/vnd.jupyter.widget-view+json" in output.get("data", {})
                      for output in cell["outputs"])
        if shown["widgets"] < widgets or "Error displaying widget" in shown["text"]:
            problems.append(f"{where}: {widgets} widget(s) sent, {shown['widgets']} rendered: "
                            f"{shown['text'][:300]!r}")
    return problems


def _exercises(notebook: dict) -> tuple[set[int], set[int]]:
    """The indices of the answer cells and of the test cells: nbgrader code cells tagged raises-exception,
    so that Run All goes on when they fail."""
    answers, tests = set(), set()
    for index, cell in enumerate(notebook["cells"]):
        nbgrader = cell["metadata"].get("nbgrader", {})
        if cell["cell_type"] == "code" and "raises-exception" in cell["metadata"].get("tags", []):
            if nbgrader.get("solution"):
                answers.add(index)
            if nbgrader.get("grade"):
                tests.add(index)
    return answers, tests


def _chapter_notebooks(chapter: str, folder: Path) -> tuple[Path, Path]:
    """The student notebook as released, and a copy with the solution's code in each answer cell (matched
    by nbgrader grade id). Each in a tree laid out as the repository (its other folders linked), so that
    paths relative to the notebook, like ../../scripts, reach what they reach from notebooks/."""
    text = (ROOT / "notebooks" / chapter / f"{chapter}.ipynb").read_text()
    solution = json.loads((ROOT / "solutions" / chapter / f"{chapter}.ipynb").read_text())
    answers = {cell["metadata"]["nbgrader"]["grade_id"]: cell["source"] for cell in solution["cells"]
               if cell["metadata"].get("nbgrader", {}).get("solution")}
    answered = json.loads(text)
    for cell in answered["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell["source"] = answers[grade_id]
    paths = []
    for kind, content in (("untouched", text), ("answered", json.dumps(answered))):
        tree = folder / kind
        path = tree / "notebooks" / chapter / f"{chapter}.ipynb"
        path.parent.mkdir(parents=True)
        path.write_text(content)
        for entry in ROOT.iterdir():
            if not entry.name.startswith(".") and entry.name not in ("notebooks", "solutions"):
                (tree / entry.name).symlink_to(entry)
        paths.append(path)
    return paths[0], paths[1]


def _move_a_slider(page, cell_index: int):
    """Move the first slider of the widget in the cell one step (back if it is at its end): the figure must
    be drawn again (a new <img>, even where the new value draws the same picture), not what_if's error."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(cell_index)
    handle = cell.locator(".widget-slider .noUi-handle").first
    handle.scroll_into_view_if_needed()
    cell.locator(".jp-OutputArea-output img").first.evaluate("img => { img.dataset.before = 'yes'; }")
    value = handle.get_attribute("aria-valuenow")
    handle.focus()
    page.keyboard.press("ArrowRight")
    if handle.get_attribute("aria-valuenow") == value:
        page.keyboard.press("ArrowLeft")
    assert handle.get_attribute("aria-valuenow") != value, "the slider did not move"
    page.wait_for_function(
        "cell => { const img = cell.querySelector('.jp-OutputArea-output img');"
        " return img === null || (!img.dataset.before && img.complete); }",
        arg=cell.element_handle(), timeout=60_000, polling=250)
    redrawn = page.evaluate(_SHOWN)[cell_index]
    assert any(redrawn["images"]) and all(redrawn["images"]), "the figure was not redrawn: " + redrawn["text"][-500:]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_chapter_runs_all_in_jupyterlab_untouched_and_answered(chapter, lab, lab_page, tmp_path):
    """Untouched: only exercise cells fail (and every test cell does), the rest run with their plots and
    widgets (a demo that needs an exercise says so instead of plotting). Answered: no error, and every
    what-if slider redraws its figure; closed and opened again, the widgets show from the saved state."""
    page = lab_page
    untouched_path, answered_path = _chapter_notebooks(chapter, lab.folder / chapter)
    answers, tests = _exercises(json.loads(untouched_path.read_text()))
    with _reported(page, lab, tmp_path / "untouched.png"):
        untouched = _walk(lab, page, untouched_path)
        _close(page)
        problems = _problems(untouched, may_fail=answers | tests)
        passing = sorted(index for index in tests if untouched.ran(index) and not untouched.tracebacks(index))
        problems += [f"{_where(untouched, index)} passes with the exercises untouched" for index in passing]
        assert not problems, f"{chapter}, untouched, Run All:\n" + "\n\n".join(problems)

    with _reported(page, lab, tmp_path / "answered.png"):
        answered = _walk(lab, page, answered_path)
        problems = _problems(answered, may_fail=set())
        assert not problems, f"{chapter}, answered, Run All:\n" + "\n\n".join(problems)
        uses_matplotlib = any("matplotlib" in "".join(cell["source"]) for cell in answered.saved["cells"])
        assert answered.plotted() or not uses_matplotlib, "no plot rendered in the whole chapter"
        sliders = page.locator(".jp-OutputArea-output .widget-slider").count()
        for index, shown in enumerate(answered.shown):
            if shown["widgets"] and page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".widget-slider").count():
                _move_a_slider(page, index)
        # Saved while the kernel is alive: ipywidgets writes only models whose comm is live (its issue #3270).
        missing_state = _widgets_without_state(_save(page, answered_path)) if sliders else []
        assert not missing_state, f"{chapter}: saved without the state of widgets {missing_state}"
        _close(page)
    # Plots of the answered chapter that are not part of an exercise show untouched too, or a demo since the
    # last exercise says which exercise to finish (demo_needs), in the plot's cell or in one before it.
    exercises = answers | tests
    missing = []
    for index in sorted(answered.plotted() - untouched.plotted() - exercises):
        since = max((exercise for exercise in exercises if exercise < index), default=-1) + 1
        if not any(DEMO_WAITS.search(untouched.shown[cell]["text"]) for cell in range(since, index + 1)):
            missing.append(_where(untouched, index))
    assert not missing, f"{chapter}, untouched: no plot and no word why in " + ", ".join(missing)

    if sliders:  # a learner comes back the next day: the saved widget state shows, not "model not found"
        with _reported(page, lab, tmp_path / "reopened.png"):
            for attempt in range(3):
                _open(page, lab, answered_path)
                page.wait_for_function(
                    "n => document.querySelectorAll('.jp-OutputArea-output .widget-slider').length >= n"
                    " || document.body.textContent.includes('Error displaying widget')", arg=sliders, timeout=90_000)
                # textContent, not innerText: a cell out of view (content-visibility) has no innerText.
                failed = "Error displaying widget" in page.locator(".jp-Notebook").text_content()
                if not failed:
                    break
                # The state is in the file (checked above). jupyterlab-manager 5 can still lose it on opening:
                # the kernel's "connected" event starts a second restore that marks the manager restored while
                # the first is waiting for the kernel's comm info before it registers the notebook's models, and
                # a view that looks its model up in that window shows "model not found" for good. Open again.
                _close(page)
            assert not failed, "the saved widget state did not show in 3 openings"
            assert page.locator(".jp-OutputArea-output .widget-slider").count() >= sliders
            _close(page)


def test_the_checks_catch_each_kind_of_failure(lab, lab_page, tmp_path):
    """A notebook that breaks each rule once: an exercise's error is allowed, a warning or a word on stderr
    is no error, and a non-exercise traceback, a syntax error, a broken plot, a widget that cannot show
    and a cell that Run All never reached are each reported."""
    exercise = {"nbgrader": {"solution": True, "grade": False, "grade_id": "stub", "locked": False}}
    cells = [  # (source, tags, metadata)
        ("import sys, warnings\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])", [], {}),
        ("raise NotImplementedError()", ["raises-exception"], exercise),
        ("warnings.warn('only a warning')", [], {}),
        ("print('Error-free output on stderr: ValueError is just a word here', file=sys.stderr)", [], {}),
        ("raise ValueError('a learner forgot something')", ["raises-exception"], {}),
        ("x = (", ["raises-exception"], {}),
        ("from IPython.display import Image\ndisplay(Image(data=b'not a png', format='png'))", [], {}),
        ("display({'application/vnd.jupyter.widget-view+json': {'model_id': 'gone', 'version_major': 2,"
         " 'version_minor': 0}}, raw=True)", [], {}),
        ("raise RuntimeError('Run All stops here')", [], {}),
        ("print('never reached')", [], {}),
    ]
    notebook = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}}, "cells": [
        {"cell_type": "code", "id": f"c{i}", "metadata": {"tags": tags, **metadata}, "source": source,
         "outputs": [], "execution_count": None} for i, (source, tags, metadata) in enumerate(cells)]}
    path = lab.folder / "checks" / "failing.ipynb"
    path.parent.mkdir()
    path.write_text(json.dumps(notebook))
    with _reported(lab_page, lab, tmp_path / "failing.png"):
        walk = _walk(lab, lab_page, path)
        _close(lab_page)
    stderr = [len(shown["stderr"]) for shown in walk.shown]
    assert stderr == [0, 1, 1, 1, 1, 1, 0, 0, 1, 0], stderr  # warnings, prints and errors all render as stderr
    problems = _problems(walk, may_fail=_exercises(notebook)[0])
    reported = [int(re.match(r"cell (\d+)", problem).group(1)) for problem in problems]
    assert reported == [4, 5, 6, 7, 8, 9], "\n".join(problems)
    assert "a learner forgot something" in problems[0] and "SyntaxError" in problems[1]
    assert "1 broken" in problems[2] and "0 rendered" in problems[3] and "did not run" in problems[5]
    assert walk.plotted() == {0}


@pytest.fixture
def make_lab(tmp_path):
    """`make lab` as a learner runs it, with --no-browser; yields the URL it printed, then stops it.

    The learner's own Jupyter settings and workspaces are kept out (fresh folders in tmp_path), so
    the course's settings in jupyter-config/ are all that shapes the lab.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "MPLBACKEND", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    for name, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                      ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("JUPYTER_RUNTIME_DIR", "runtime")):
        env[name] = str(tmp_path / sub)
    lab = subprocess.Popen(["make", "--no-print-directory", "lab", "LAB_ARGS=--no-browser"], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    printed, server = [], None
    threading.Thread(target=lambda: printed.extend(lab.stdout), daemon=True).start()
    try:
        deadline = time.time() + 120
        while not (found := re.search(r"http://localhost:\d+/\S+", "".join(printed))) or server is None:
            if lab.poll() is not None or time.time() > deadline:
                pytest.fail("make lab printed no URL:\n" + "".join(printed)[-3000:])
            if info := sorted((tmp_path / "runtime").glob("jpserver-*.json")):  # the server's pid and URL
                server = json.loads(info[0].read_text())
            time.sleep(0.5)
        yield found.group(0), "".join(printed)
    finally:
        if server:  # kernels run in sessions of their own, out of reach of the signal below
            with contextlib.suppress(OSError):
                api, token = f"{server['url']}api/kernels", server["token"]
                for kernel in json.load(urllib.request.urlopen(f"{api}?token={token}", timeout=10)):
                    urllib.request.urlopen(urllib.request.Request(
                        f"{api}/{kernel['id']}?token={token}", method="DELETE"), timeout=30)
        os.killpg(lab.pid, signal.SIGTERM)  # make, its shell and JupyterLab: the group make leads
        lab.wait()
        # JupyterLab shuts down, but once a notebook was opened it can then hang at exit, waiting for an
        # idle anyio worker thread (jupyter_server 2.21.1): give it a moment, then kill what is left (its
        # kernels were shut down above).
        deadline = time.time() + 3
        while server and _alive(server["pid"]) and time.time() < deadline:
            time.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lab.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie, which init may be slow to reap, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_make_lab_lands_on_the_rendered_index_without_news_or_instructor_tools(make_lab, browser, tmp_path):
    url, printed = make_lab
    assert "/lab/tree/README.md?token=" in url, printed
    base, token = url.split("/lab/")[0], url.split("token=")[1]
    with pytest.raises(urllib.error.HTTPError):  # nbgrader's formgrader server extension is off
        urllib.request.urlopen(f"{base}/formgrader?token={token}", timeout=10)
    with _page(browser, tmp_path / "failure.png") as page:
        page.goto(url, timeout=90_000)
        link = page.locator(".jp-MarkdownViewer .jp-RenderedMarkdown a", has_text="When are several GPUs worth it")
        link.wait_for(timeout=90_000)  # Markdown Preview, not the text editor
        assert page.locator(".jp-FileEditor").count() == 0
        page.wait_for_timeout(5_000)  # the news question comes a moment after start-up
        assert page.locator(".Toastify__toast").all_inner_texts() == []
        menus = page.locator("li.lm-MenuBar-item").all_inner_texts()
        assert "Run" in menus and "Nbgrader" not in menus, menus
        shown = page.locator("body").inner_text()
        for tool in ("Formgrader", "Create Assignment", "Nbgrader"):
            assert tool not in shown, tool
        link.click()  # opens the chapter in the lab, where learners keep nbgrader's Validate button
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        assert page.locator(".jp-Toolbar-item", has_text="Validate").count() == 1
        # A kernel still starting holds up the server's shutdown; let it come up first.
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
