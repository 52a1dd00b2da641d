"""The course in a real browser: JupyterLab on localhost, driven by Playwright with Debian's Chromium.

The notebook is the student version with each answer cell filled in from the solution, as a learner
who has done the exercises would have it: every cell must run without an error, a plot must render,
and moving a what-if slider must change the figure. Screenshots are written on failure.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHAPTER = os.environ.get("BROWSER_TEST_CHAPTER", "00_when_to_use_gpus")

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is installed by `make setup`")
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed (.ci/run installs it)", allow_module_level=True)


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


def test_a_chapter_runs_in_jupyterlab_with_plots_and_a_working_widget(jupyterlab, tmp_path):
    url, token, folder = jupyterlab
    notebook = _answered_student_notebook(CHAPTER, folder)
    shutil.copytree(ROOT / "course", folder / "course")  # the kernel imports the course package
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{url}/lab/tree/{notebook.name}?token={token}", timeout=90_000)
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
                "el => /\\[\\d+\\]/.test(el.textContent)", arg=last_prompt.element_handle(),
                timeout=240_000)

            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']")
            assert errors.count() == 0, "error output: " + errors.first.inner_text()[:2000]
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
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            print(f"screenshot: {tmp_path / 'failure.png'}")
            raise
        finally:
            browser.close()
