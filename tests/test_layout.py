"""The package's layers (course/__init__.py says what each holds): lessons -> cuda -> machine, imports never
upward and never in a cycle.

Every module of course/ is parsed (not imported), and every import in it is checked, function-local ones too: a
function-local import is still a dependency, and hiding a cycle in one is what this test is here to stop.
"""
import ast
import shutil
from pathlib import Path

import pytest

COURSE = Path(__file__).resolve().parents[1] / "course"
LAYERS = ("machine", "cuda", "lessons")  # bottom to top; the package root's entry points sit above them all
ENTRY_POINTS = {"course", "course.__main__", "course.autostart"}


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(root: Path, name: str, tree) -> list[tuple[str, int]]:
    """(imported course module, line) for every import statement in the module, wherever it is."""
    modules = {_module_name(root, p) for p in root.rglob("*.py")}
    package = name if (root.parent / Path(*name.split(".")) / "__init__.py").exists() else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "course"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "course":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules else base, node.lineno))
    return found


def _layer(name: str) -> int:
    """0, 1, 2 for machine, cuda, lessons; 3 for the package root and its entry points."""
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def violations(root: Path = COURSE) -> list[str]:
    """What breaks the layering, each naming the file, line and import."""
    problems, graph = [], {}
    for path in sorted(root.rglob("*.py")):
        name = _module_name(root, path)
        where = path.relative_to(root.parent)
        if _layer(name) == len(LAYERS) and name not in ENTRY_POINTS:
            problems.append(f"{where}: in no layer (put it in course/{'|'.join(LAYERS)}/)")
        graph[name] = {}
        for target, line in _imports(root, name, ast.parse(path.read_text(), str(path))):
            if name in ENTRY_POINTS:
                graph[name].setdefault(target, line)
                continue
            if _layer(target) == len(LAYERS):
                problems.append(f"{where}:{line}: imports the package root ({target}); import the module itself")
            elif _layer(target) > _layer(name):
                problems.append(f"{where}:{line}: upward import of {target} ({LAYERS[_layer(target)]}) from "
                                f"{LAYERS[_layer(name)]}")
            graph[name].setdefault(target, line)
    problems += _cycles(root, graph)
    return problems


def _cycles(root: Path, graph: dict) -> list[str]:
    """Each import cycle once, as the chain of imports that closes it (a package's __init__ is not in it:
    importing `course.cuda.devices` runs course/cuda/__init__.py, which imports nothing)."""
    found, done, stack = [], set(), []

    def visit(module):
        stack.append(module)
        for target, line in graph.get(module, {}).items():
            if target in stack:
                loop = stack[stack.index(target):]
                steps = [f"{a} -> {b} (line {graph[a][b]})" for a, b in zip(loop, loop[1:] + [target])]
                found.append("import cycle: " + ", ".join(steps))
            elif target not in done and target in graph:
                visit(target)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return found


def test_the_package_is_layered_with_no_upward_import_and_no_cycle():
    assert violations() == []


def test_every_layer_is_populated_and_the_entry_points_exist():
    """The check above must be looking at the real package: three layers with modules, and the entry points."""
    names = {_module_name(COURSE, p) for p in COURSE.rglob("*.py")}
    for layer in LAYERS:
        assert len([n for n in names if n.startswith(f"course.{layer}.")]) >= 5, layer
    assert ENTRY_POINTS <= names


@pytest.fixture
def course_copy(tmp_path):
    copy = tmp_path / "course"
    shutil.copytree(COURSE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _append(path: Path, code: str) -> int:
    """Add code at the end of a module; the line it lands on."""
    text = path.read_text()
    path.write_text(text + code)
    return text.count("\n") + 1


def test_an_upward_import_is_named(course_copy):
    line = _append(course_copy / "machine" / "costs.py", "from course.lessons.ddp_timing import simulate_ddp_step\n")
    upward = f"course/machine/costs.py:{line}: upward import of course.lessons.ddp_timing (lessons) from machine"
    problems = violations(course_copy)
    assert problems[0] == upward
    # ddp_timing needs the emulator and costs: the same import also closes cycles, named through it
    assert problems[1:] and all(f"course.machine.costs -> course.lessons.ddp_timing (line {line})" in p
                                for p in problems[1:]), problems


def test_a_function_local_upward_import_is_named_too(course_copy):
    line = _append(course_copy / "cuda" / "transfers.py", "\n\ndef _late():\n    from course.cuda import emulator\n")
    problems = violations(course_copy)
    assert f"course/cuda/transfers.py:{line + 3}: upward import" not in " ".join(problems)  # same layer: allowed
    assert any(p.startswith("import cycle: ") and "course.cuda.transfers -> course.cuda.emulator" in p
               for p in problems), problems


def test_importing_the_package_root_is_named(course_copy):
    line = _append(course_copy / "lessons" / "tiles.py", "import course\n")
    assert violations(course_copy) == [
        f"course/lessons/tiles.py:{line}: imports the package root (course); import the module itself"]


def test_a_module_outside_the_layers_is_named(course_copy):
    (course_copy / "stray.py").write_text('"""A helper added at the top of the package."""\n')
    assert violations(course_copy) == ["course/stray.py: in no layer (put it in course/machine|cuda|lessons/)"]
