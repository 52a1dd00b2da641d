"""The one-page summary (solutions/which_strategy_when.md) quotes figures the chapters print; this keeps it honest.

Each bullet of "What the course measured" links the chapter that prints its figures. Every number in the bullet
must be one that chapter prints (in its stored outputs, as nbval keeps them current), rounded to the digits the
page shows, or an input written in the chapter's code. A timing change in the emulator that moves a chapter's
output then fails here until the page is updated, instead of leaving a stale figure behind.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "solutions" / "which_strategy_when.md"
NUMBER = re.compile(r"(?<![\w.$])\d+(?:\.\d+)?(?![\w$])")  # on the page: not in names or $math$
PRINTED = re.compile(r"(?<![\d.])\d+(?:\.\d+)?")  # in outputs: also 0.87x, 950.1ms


def _bullets() -> list[tuple[str, str]]:
    """(chapter, text of the bullet before its chapter link) for each measured figure's bullet."""
    section = PAGE.read_text().split("## What the course measured")[1].split("\nCited, not measured")[0]
    bullets = []
    for bullet in section.split("\n- ")[1:]:
        chapters = re.findall(r"\]\((\d\d_[a-z_]+)/", bullet)
        assert chapters, f"a bullet of {PAGE.name} links no chapter: {bullet[:60]!r}"
        bullets.append((chapters[0], bullet.split("[Chapter")[0]))
    return bullets


def _chapter_text(chapter: str) -> tuple[list[float], str]:
    """The numbers a chapter's stored outputs print, and its code."""
    notebook = json.loads((ROOT / "solutions" / chapter / f"{chapter}.ipynb").read_text())
    printed, code = [], []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        code.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
            printed += [float(n) for n in PRINTED.findall(text)]
    return printed, "\n".join(code)


def test_the_page_has_measured_figures():
    assert len(_bullets()) >= 5


@pytest.mark.parametrize("chapter,text", _bullets(), ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "")
def test_every_figure_is_one_the_chapter_prints(chapter, text):
    printed, code = _chapter_text(chapter)
    stale = []
    for figure in NUMBER.findall(text):
        digits = len(figure.split(".")[1]) if "." in figure else 0
        value, half_step = float(figure), 0.5 * 10 ** -digits
        if not any(abs(p - value) <= half_step + 1e-9 for p in printed) and not re.search(rf"\b{figure}\b", code):
            stale.append(figure)
    assert not stale, (f"{PAGE.name} quotes {stale} for {chapter}, which neither prints them (rounded as the page "
                       f"rounds) nor uses them as inputs: re-read the chapter's outputs and update the page")


def test_the_learners_copy_is_the_same_page():
    """notebooks/ holds the page learners open; it is a copy of the instructors' one, kept by hand."""
    learners = ROOT / "notebooks" / PAGE.name
    assert learners.read_text() == PAGE.read_text(), f"copy {PAGE} to {learners}"
