"""Static scan of the learner's cells for code that targets the grader: flagged for review, never scored.

The sandbox and the in-kernel guard decide the score; this only points the instructor at submissions
worth a look (an `__eq__` can be innocent, a `gc.get_objects()` in a matmul exercise is not).
"""
import re

PATTERNS = {
    "references": r"\breferences\b", "grading": r"\bgrading\b", "gradebook": r"gradebook", "autograder": r"autograder",
    "patches course": r"\bcourse\.[\w.]+\s*=[^=]|setattr\(\s*course\b",
    "patches torch/numpy checks": r"(allclose|assert_close|\.equal|isclose|testing\.\w+)\s*=[^=]",
    "builtins": r"\bbuiltins\b|__builtins__", "custom __eq__": r"def\s+__(eq|ne|lt|le|gt|ge|bool)__",
    "__torch_function__": r"__torch_function__", "frame/gc introspection": r"_getframe|\bgc\.get_|__closure__|f_back|tb_frame|inspect\.",
    "grader internals": (r"__grader|events\.(callbacks|unregister)|meta_path|sys\.modules\b|ast_transformers|addaudithook"
                         r"|set_custom_exc|CustomTB|showtraceback|excepthook|run_cell"),
    "ctypes/processes": r"\bctypes\b|os\.(system|fork|exec|_exit|kill)|subprocess|signal\.", "network": r"\bsocket\b|urllib|requests\.",
}


def suspicious(nb) -> list[str]:
    """Names of the patterns found in cells the learner could edit (not locked, not grade cells)."""
    found = []
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") != "code" or meta.get("locked") or meta.get("grade"):
            continue
        src = cell.source if isinstance(cell.source, str) else "".join(cell.source)
        found += [name for name, rx in PATTERNS.items() if re.search(rx, src) and name not in found]
    return ["review: " + ", ".join(found)] if found else []
