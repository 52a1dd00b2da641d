"""The course in a real browser: JupyterLab on localhost, driven by Playwright with Debian's Chromium.

- `make lab` lands on the rendered index (links to the chapters that open them), with no news pop-up
  and none of nbgrader's instructor tools, at the URL it prints.
- A chapter: the student notebook with each answer cell filled in from the solution, as a learner who
  has done the exercises would have it: every cell must run without an error, a plot must render,
  moving a what-if slider must change the figure, and the notebook saved, closed and reopened shows its
  widget again (the course's lab settings save widget state).
- The error check itself: JupyterLab 4 renders a traceback with the stderr mime type, as it renders a
  warning, so the check reads the text; a deliberately failing notebook proves it catches both kinds.

Screenshots are written on failure. Without chromium these tests fail, or skip with ALLOW_SKIP=1
(tests/conftest.py).
"""
import contextlib
import json
import os
import re
import shutil
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
CHAPTER = os.environ.get("BROWSER_TEST_CHAPTER", "00_when_to_use_gpus")

pytestmark = pytest.mark.needs("browser")

# JupyterLab 4 renders an error output as application/vnd.jupyter.stderr, like a warning or a print to
# sys.stderr: a traceback is told apart by its text, "Traceback (most recent call last)" (IPython prints
# it for every raised exception) or a line starting with the exception's name (SyntaxError has no traceback).
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^[\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)", re.M)


def _answered_student_notebook(chapter: str, folder: Path) -> Path:
    """The student notebook with the solution's code in each answer cell."""
    student = json.loads((ROOT / "notebooks" / chapter / f"{chapter}.ipynb").read_text())
    solution = json.loads((ROOT / "solutions" / chapter / f"{chapter}.ipynb").read_text())
    answers = {c["metadata"]["nbgrader"]["grade_id"]: c["source"] for c in solution["cells"]
               if c["metadata"].get("nbgrader", {}).get("solution")}
    for cell in student["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell["source"] = answers[grade_id]
    path = folder / f"{chapter}.ipynb"
    path.write_text(json.dumps(student))
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on a free localhost port, serving a scratch folder; stopped afterwards."""
    port, token = _free_port(), "course-browser-test"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MPLBACKEND")}
    env["JUPYTER_CONFIG_PATH"] = str(ROOT / "jupyter-config")  # the course's lab settings, as make lab has them
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
               "--ServerApp.disable_check_xsrf=True", "--LabApp.news_url=", "--allow-root"]
    server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "jupyterlab.log", "w"))
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
        pytest.fail("JupyterLab did not start: " + (tmp_path / "jupyterlab.log").read_text()[-2000:])
    yield url, token, tmp_path
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


def _tracebacks(page) -> list[str]:
    """The text of every error output on the page (not warnings or other stderr output)."""
    outputs = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'],"
                           ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']")
    return [text for text in outputs.all_inner_texts() if TRACEBACK.search(text)]


@contextlib.contextmanager
def _page(tmp_path):
    """A Chromium page; a screenshot of it in tmp_path if the test fails."""
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            yield page
        except BaseException:
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            print(f"screenshot: {tmp_path / 'failure.png'}")
            raise
        finally:
            browser.close()


def _run_all(page, url: str):
    """Open the notebook at url, run all its cells and wait until the last one has run."""
    page.goto(url, timeout=90_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    # Run the first code cell until it has a result: keystrokes sent before the kernel's
    # websocket is connected are dropped, and no indicator says when that is.
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    first_prompt = cells.first.locator(".jp-InputPrompt")
    for _ in range(12):
        cells.first.click()
        page.keyboard.press("Control+Enter")
        try:
            page.wait_for_function("el => /\\[\\d+\\]/.test(el.textContent)",
                                   arg=first_prompt.element_handle(), timeout=10_000)
            break
        except playwright.TimeoutError:
            continue
    page.locator("li.lm-MenuBar-item", has_text="Run").first.click()
    page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()
    last_prompt = cells.last.locator(".jp-InputPrompt")
    page.wait_for_function(
        "el => /\\[\\d+\\]/.test(el.textContent)", arg=last_prompt.element_handle(), timeout=240_000)


def test_a_chapter_runs_in_jupyterlab_with_plots_and_a_working_widget(jupyterlab, tmp_path):
    url, token, folder = jupyterlab
    notebook = _answered_student_notebook(CHAPTER, folder)
    shutil.copytree(ROOT / "course", folder / "course")  # the kernel imports the course package
    with _page(tmp_path) as page:
        _run_all(page, f"{url}/lab/tree/{notebook.name}?token={token}")
        errors = _tracebacks(page)
        assert not errors, "error output: " + errors[0][:2000]
        images = page.locator(".jp-OutputArea-output img")
        assert images.count() >= 1, "no plot was rendered"

        slider = page.locator(".widget-slider .noUi-handle, .widget-slider input[type=range]").first
        slider.scroll_into_view_if_needed()
        widget_area = slider.locator("xpath=ancestor::div[contains(@class,'jp-Cell')]").first
        figure = widget_area.locator(".jp-OutputArea-output img").first
        before = figure.get_attribute("src")
        slider.focus()
        for _ in range(3):
            page.keyboard.press("ArrowRight")
        # The update replaces the <img> element, so look it up afresh each time.
        page.wait_for_function(
            "([cell, old]) => { const img = cell.querySelector('.jp-OutputArea-output img');"
            " return img !== null && img.getAttribute('src') !== old; }",
            arg=[widget_area.element_handle(), before], timeout=60_000)

        # Saved, closed (its kernel shut down) and opened again, as a learner comes back the next day: the
        # widget's state was saved with the notebook, so it shows again instead of "model not found".
        page.keyboard.press("Control+s")
        deadline = time.time() + 60
        while "application/vnd.jupyter.widget-state+json" not in json.loads(notebook.read_text())["metadata"].get(
                "widgets", {}):
            assert time.time() < deadline, "the saved notebook has no widget state"
            time.sleep(1)
        api = f"{url}/api/kernels"
        for kernel in json.load(urllib.request.urlopen(f"{api}?token={token}", timeout=10)):
            urllib.request.urlopen(urllib.request.Request(f"{api}/{kernel['id']}?token={token}", method="DELETE"),
                                   timeout=30)
        page.goto(f"{url}/lab/tree/{notebook.name}?token={token}", timeout=90_000)
        page.locator(".widget-slider").first.wait_for(timeout=90_000)
        assert page.locator(".jp-OutputArea-output", has_text="Error displaying widget").count() == 0


def test_the_error_check_catches_raised_exceptions_but_not_warnings(jupyterlab, tmp_path):
    url, token, folder = jupyterlab
    cells = [("import sys, warnings\nwarnings.warn('only a warning')", []),
             ("print('Error-free output on stderr: ValueError is just a word here', file=sys.stderr)", []),
             ("raise ValueError('a learner forgot something')", ["raises-exception"]),  # Run All goes on
             ("x = (", ["raises-exception"]),
             ("print('the end')", [])]
    notebook = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}}, "cells": [
        {"cell_type": "code", "id": f"c{i}", "metadata": {"tags": tags}, "source": source, "outputs": [],
         "execution_count": None} for i, (source, tags) in enumerate(cells)]}
    (folder / "failing.ipynb").write_text(json.dumps(notebook))
    with _page(tmp_path) as page:
        _run_all(page, f"{url}/lab/tree/failing.ipynb?token={token}")
        page.locator(".jp-OutputArea-output", has_text="the end").wait_for(timeout=30_000)  # ran to the end
        stderr = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        assert stderr.count() == 4  # the warning, the print and both errors all render as stderr
        errors = _tracebacks(page)
        assert len(errors) == 2, errors
        assert "ValueError" in errors[0] and "a learner forgot something" in errors[0]
        assert "SyntaxError" in errors[1]


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
        # idle anyio worker thread (jupyter_server 2.21.1): give it a moment, then kill what is left.
        deadline = time.time() + 10
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


def test_make_lab_lands_on_the_rendered_index_without_news_or_instructor_tools(make_lab, tmp_path):
    url, printed = make_lab
    assert "/lab/tree/README.md?token=" in url, printed
    base, token = url.split("/lab/")[0], url.split("token=")[1]
    with pytest.raises(urllib.error.HTTPError):  # nbgrader's formgrader server extension is off
        urllib.request.urlopen(f"{base}/formgrader?token={token}", timeout=10)
    with _page(tmp_path) as page:
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
