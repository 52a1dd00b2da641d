"""The grading guard counts any change to a module-level dict or list of `course` during a test cell as tampering,
except the emulator's per-op caches it names (autograder/pipeline/guard.py, CACHES). A cache renamed or added in
`course` without updating that list makes every graded notebook read as tampered: checked here, in the quick suite,
rather than only by the sandboxed grading run."""
import ast
import importlib
import pkgutil
import sys
import threading
from pathlib import Path

import torch

import course

GUARD = Path(__file__).resolve().parent.parent / "autograder" / "pipeline" / "guard.py"


def _guard_caches() -> set[tuple[str, str]]:
    for node in ast.walk(ast.parse(GUARD.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CACHES" for t in node.targets):
            return {tuple(ast.literal_eval(element)) for element in node.value.elts}
    raise AssertionError("guard.py no longer defines CACHES")


def test_the_tables_the_emulator_changes_as_it_runs_are_the_guards_caches():
    caches = _guard_caches()
    for module, name in caches:
        assert isinstance(getattr(importlib.import_module(module), name, None), dict), f"{module}.{name} is gone"
    for info in pkgutil.walk_packages(course.__path__, "course."):
        importlib.import_module(info.name)
    tables = [(name, attr, table, table.copy()) for name, module in sorted(sys.modules.items())
              if name == "course" or name.startswith("course.")
              for attr, table in vars(module).items()
              if isinstance(table, (dict, list)) and not attr.startswith("__") and (name, attr) not in caches]
    with course.emulate(gpus=2):  # what a chapter does: matmuls, backward, an optimizer, attention, a thread
        x = torch.randn(64, 64, device="cuda:1", requires_grad=True)
        (x @ x.t()).relu().sum().backward()
        torch.optim.AdamW([x]).step()
        attention = torch.nn.MultiheadAttention(8, 2).cuda()
        attention(*3 * [torch.randn(3, 2, 8, device="cuda")])
        worker = threading.Thread(target=lambda: torch.ones(2, device="cuda").sum())
        worker.start()
        worker.join()
    changed = [f"{name}.{attr}" for name, attr, table, saved in tables
               if len(table) != len(saved) or any(a is not b for a, b in (
                   ((table.get(k), v) for k, v in saved.items()) if isinstance(table, dict) else zip(table, saved)))]
    assert not changed, f"module-level tables the guard would call tampering: {changed}; add them to CACHES"
