"""Static scan of the learner's cells for code that targets the grader: flagged for review, never scored.

The sandbox and the in-kernel guard decide the score; this only points the instructor at submissions
worth a look (an `__eq__` can be innocent, a `gc.get_objects()` in a matmul exercise is not).
"""
import ast
import re

PATTERNS = {
    "references": r"\breferences\b", "grading": r"\bgrading\b", "gradebook": r"gradebook", "autograder": r"autograder",
    "replaces function code": r"\.__(code|defaults|kwdefaults)__\s*=[^=]",
    "emulator internals": r"\._events\b|\.clock\b|\bdevices\.active\b|_pinned_storages|_OP_INFO|_TERMS_BY_SHAPE",
    "patches torch/numpy checks": r"(allclose|assert_close|\.equal|isclose|testing\.\w+)\s*=[^=]",
    "builtins": r"\bbuiltins\b|__builtins__", "custom __eq__": r"def\s+__(eq|ne|lt|le|gt|ge|bool)__",
    "__torch_function__": r"__torch_function__", "frame/gc introspection": r"_getframe|\bgc\.get_|__closure__|f_back|tb_frame|inspect\.",
    "grader internals": (r"__grader|events\.(callbacks|unregister)|meta_path|sys\.modules\b|ast_transformers|addaudithook"
                         r"|set_custom_exc|CustomTB|showtraceback|excepthook|run_cell|\bglobals\(\)|user_ns|__main__"),
    "ctypes/processes": r"\bctypes\b|os\.(system|fork|exec|_exit|kill)|subprocess|signal\.", "network": r"\bsocket\b|urllib|http\.client|\brequests\.(get|post|put|Session)\b",
}


def _tree(src: str):
    try:
        return ast.parse(src)
    except SyntaxError:  # IPython magics and the like: the regular expressions still look at it
        return ast.Module([], [])


def _course_names(trees) -> set[str]:
    """Names the notebook binds to `course` or to anything imported from it, under any alias."""
    names = {"course"}
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Import):
            names |= {a.asname or "course" for a in node.names if a.name.split(".")[0] == "course"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "course":
            names |= {a.asname or a.name for a in node.names}
    return names


def _patches_course(tree, names: set[str]) -> bool:
    """An assignment, deletion or setattr into something reached from `course` (the instrument hidden tests
    measure with), however it was imported."""
    def inside(expr):
        while isinstance(expr, (ast.Attribute, ast.Subscript)):
            expr = expr.value
        return isinstance(expr, ast.Name) and expr.id in names

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr") and node.args:
            if inside(node.args[0]):
                return True
            continue
        else:
            continue
        if any(isinstance(t, (ast.Attribute, ast.Subscript)) and inside(t.value) for t in targets):
            return True
    return False


def _source(cell) -> str:
    return cell.source if isinstance(cell.source, str) else "".join(cell.source)


def suspicious(nb, released=None) -> list[str]:
    """Names of the patterns found in code the learner wrote: cells they could edit (not locked, not grade
    cells) whose source differs from every code cell of the `released` student notebook."""
    as_released = {_source(c) for c in (released.cells if released else []) if c.get("cell_type") == "code"}
    sources = [(_source(cell), cell) for cell in nb.cells if cell.get("cell_type") == "code"]
    trees = [_tree(src) for src, _ in sources]
    names = _course_names(trees)
    found = []
    for (src, cell), tree in zip(sources, trees):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("locked") or meta.get("grade") or src in as_released:
            continue
        found += [name for name, rx in PATTERNS.items() if re.search(rx, src) and name not in found]
        if _patches_course(tree, names) and "patches course" not in found:
            found.append("patches course")
    return ["review: " + ", ".join(found)] if found else []
