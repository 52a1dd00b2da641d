"""IPython startup file for the sandboxed grading kernel (copied into the sandbox's IPYTHONDIR).

It runs before the first cell, so it sees the real torch/numpy/builtins before learner code can touch them.
Two layers decide a test cell (autograder/README.md, "What stops which cheat"):
- layer 2, the verdict that matters: hidden tests only record the learner's results through the `grading`
  module this file installs (learner mode: `grading.check` prints them on marker lines, reference thunks are
  never called); the pipeline compares them with the expected results outside the kernel, after it is gone.
  Neither the reference implementations nor the expected values ever enter this process.
- layer 1, here: before every cell the comparison helpers, builtins and the instrument hidden tests measure
  with (the emulator in `course`, and `grading`) are put back, so top-level monkey-patching is undone; a change
  to any of them during a test cell is tampering; in test cells comparisons and torch/numpy checks refuse
  operands whose type the submission defined (an `__eq__` that is always true, a tensor subclass, ...);
  frame/garbage-collector introspection by learner code during a test cell is recorded as tampering.
After each test cell the guard prints one marker line: `<nonce> ok`, `<nonce> error: ExceptionType` (the cell
raised) or `<nonce> tamper: why`. The pipeline zeroes a test cell whose marker says tamper, is missing, or says
error while the cell shows no error output (the error was hidden), then strips the markers. Code written
against this guard can defeat layer 1 (it shares the process); it cannot make layer 2 accept wrong results.
"""


def _grader_guard():
    import ast, builtins, hashlib, json, os, sys, threading  # noqa: E401

    cfg_path = os.environ.pop("GRADER_GUARD")
    with open(cfg_path) as f:
        cfg = json.load(f)
    os.unlink(cfg_path)
    nonce, tests = cfg["nonce"], set(cfg["tests"])
    grading = type(sys)("grading")
    grading.__file__ = "<grading>"
    exec(compile(cfg["grading"], "<grading>", "exec"), grading.__dict__)
    grading.configure("learner", nonce)
    del cfg

    import numpy
    import numpy.testing
    import torch
    import torch.testing

    ip = get_ipython()  # noqa: F821 - defined in IPython startup files
    out = sys.stdout
    getframe = sys._getframe
    state = {"test": False, "file": None, "tamper": [], "busy": False}
    # The emulator's own state, which changes as it runs (the active emulator); and its per-op caches.
    EMULATOR_STATE = {"course.cuda.devices": ("active",)}
    CACHES = {("course.cuda.kernels", "_OP_INFO"), ("course.cuda.kernels", "_TERMS_BY_SHAPE")}
    MISSING = object()
    roots = {"builtins", "torch", "numpy", "course"}
    # torch's own classes as imported, before anything ran: while the emulator runs, `torch.device` names its
    # wrapper, but the devices it makes are still PyTorch's own class.
    torch_classes = {id(v): v for v in vars(torch).values() if isinstance(v, type)}

    def trusted_type(t):
        if torch_classes.get(id(t)) is t:
            return True
        if t.__module__ == "builtins":
            return getattr(builtins, t.__qualname__, None) is t or t in (type(None), type(...), type(NotImplemented))
        mod = sys.modules.get(t.__module__)
        if t.__module__.split(".")[0] not in roots or mod is None:
            return False
        obj = mod
        for part in t.__qualname__.split("."):
            obj = getattr(obj, part, None)
        return obj is t

    def check(x, depth=0, budget=[0]):
        """Raise unless x is built only from types the submission did not define."""
        if depth == 0:
            budget[0] = 0
        budget[0] += 1
        if budget[0] > 20000 or depth > 20:
            return
        t = type(x)
        if not trusted_type(t):
            raise AssertionError(f"grader: a test compared an object of type {t.__qualname__} defined by the submission")
        if t in (list, tuple, set, frozenset) or (isinstance(x, tuple) and t.__module__.startswith("torch")):
            for item in x:
                check(item, depth + 1)
        elif t is dict:
            for k, v in x.items():
                check(k, depth + 1)
                check(v, depth + 1)

    def snapshot_instrument(grading):
        """What hidden tests measure with: every name bound in `course.*` and `grading` (its identity), every
        class attribute there (and no new ones), every function's code and defaults, the contents of their
        tables. Taken before learner code runs; `instrument_changes` compares with it and puts it back."""
        import importlib, pkgutil, types  # noqa: E401
        import course
        for info in pkgutil.walk_packages(course.__path__, "course."):  # all of it, before learner code runs
            importlib.import_module(info.name)
        modules = [grading] + [m for n, m in sorted(sys.modules.items()) if n == "course" or n.startswith("course.")]
        bindings, functions, tables, caches = [], {}, [], []

        def remember_function(fn):
            fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
            wrapped = getattr(fn, "__wrapped__", None)
            if hasattr(fn, "cache_clear"):
                caches.append(fn)
            for f in (fn, wrapped):
                if isinstance(f, types.FunctionType):
                    functions[f] = (f.__code__, f.__defaults__, f.__kwdefaults__)

        for mod in modules:
            bindings.append((mod, dict(vars(mod)), EMULATOR_STATE.get(mod.__name__, ())))
            for name, value in vars(mod).items():
                if (mod.__name__, name) in CACHES:
                    caches.append(value)
                elif isinstance(value, (dict, list)) and not name.startswith("__"):  # not __builtins__
                    tables.append((value, value.copy()))
                elif isinstance(value, type) and value.__module__ == mod.__name__:
                    bindings.append((value, dict(vars(value)), ()))
                    for member in vars(value).values():
                        for fn in ((member.fget, member.fset, member.fdel) if isinstance(member, property) else (member,)):
                            remember_function(fn)
                elif callable(value):
                    remember_function(value)
        return bindings, functions, tables, caches

    def instrument_changes(fix):
        """Names of what changed in the instrument since the snapshot; with `fix`, each is put back."""
        bindings, functions, tables, caches = instrument
        changed = []
        for owner, saved, exempt in bindings:
            now = vars(owner)
            added = [n for n in now if n not in saved and not n.startswith("__")]  # Python adds dunders
            for name in added + [n for n, v in saved.items() if n not in exempt and now.get(n, MISSING) is not v]:
                changed.append(f"{owner.__name__}.{name}")
                if fix:
                    try:
                        setattr(owner, name, saved[name]) if name in saved else delattr(owner, name)
                    except (AttributeError, TypeError):  # cannot be put back: still reported, so tests fail closed
                        pass
        for fn, (code, defaults, kwdefaults) in functions.items():
            if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults:
                changed.append(f"{fn.__module__}.{fn.__qualname__}.__code__")
                if fix:
                    fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, kwdefaults
        for table, saved in tables:
            pairs = ((table.get(k, MISSING), v) for k, v in saved.items()) if isinstance(table, dict) else zip(table, saved)
            if len(table) != len(saved) or any(a is not b for a, b in pairs):
                changed.append(f"a table of {type(table).__name__} in course")
                if fix:
                    table.clear()
                    table.update(saved) if isinstance(table, dict) else table.extend(saved)
        return changed

    def clear_caches():
        """Results cached from learner cells may have been computed with a patched instrument."""
        for cache in instrument[3]:
            cache.clear() if isinstance(cache, dict) else cache.cache_clear()

    def strict(fn):
        def wrapper(*args, **kwargs):
            if state["test"]:
                for a in (*args[:2], *[kwargs[k] for k in ("actual", "expected", "input", "other", "desired", "a", "b")
                                       if k in kwargs]):
                    check(a)
            return fn(*args, **kwargs)
        wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = fn.__name__, fn.__doc__, fn
        return wrapper

    guarded = [(torch, n) for n in ("allclose", "equal", "isclose")] + [(torch.testing, "assert_close")]
    guarded += [(numpy, n) for n in ("allclose", "array_equal", "isclose", "array_equiv")]
    guarded += [(numpy.testing, n) for n in dir(numpy.testing) if n.startswith("assert_")]
    expected = [(mod, name, strict(getattr(mod, name))) for mod, name in guarded]
    real_builtins = dict(vars(builtins))
    instrument = snapshot_instrument(grading)

    OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
           ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
    import operator
    FUNCS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
             ">=": operator.ge, "in": lambda a, b: a in b, "not in": lambda a, b: a not in b,
             "is": operator.is_, "is not": operator.is_not}

    def grader_cmp(ops, *operands):
        """Python's own semantics: one comparison gives its result (a tensor for `got != want`), a chain the first
        falsy result or the last one."""
        for i, op in enumerate(ops):
            a, b = operands[i], operands[i + 1]
            if op not in ("is", "is not"):
                check(a)
                check(b)
            result = FUNCS[op](a, b)
            if i < len(ops) - 1 and not result:
                return result
        return result

    class StrictCompare(ast.NodeTransformer):
        def visit_Compare(self, node):
            self.generic_visit(node)
            ops = ast.Tuple([ast.Constant(OPS[type(o)]) for o in node.ops], ast.Load())
            call = ast.Call(ast.Name("__grader_cmp__", ast.Load()), [ops, node.left, *node.comparators], [])
            return ast.copy_location(call, node)

    class TestCellsOnly(ast.NodeTransformer):
        def visit(self, node):
            return StrictCompare().visit(node) if state["test"] else node

    def restore():
        for mod, name, fn in expected:
            if getattr(mod, name, None) is not fn:
                setattr(mod, name, fn)
        for k, v in real_builtins.items():
            if vars(builtins).get(k) is not v:
                setattr(builtins, k, v)
        instrument_changes(fix=True)
        builtins.__grader_cmp__ = grader_cmp
        ip.user_ns.pop("__grader_cmp__", None)  # a global of that name would shadow the builtin
        sys.modules["grading"] = grading

    def learner_frame(frame):
        """The first frame above the guard/stdlib helpers: learner cell code other than this test cell?"""
        while frame is not None and frame.f_code.co_filename.endswith(("inspect.py", "traceback.py", "guard.py")):
            frame = frame.f_back
        if frame is None:
            return False
        name = frame.f_code.co_filename
        return name != state["file"] and (name.startswith(tempdir) or name.startswith("<"))

    tempdir = os.path.dirname(ip.compile.get_code_name("x = 1", "x = 1", 0))

    def audit(event, args):
        if not state["test"] or state["busy"]:
            return
        if event in ("sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
                     "gc.get_referents") or (event == "object.__getattr__" and args[1] in (
                     "tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "__closure__")):
            state["busy"] = True
            try:
                if learner_frame(getframe(1)):
                    state["tamper"].append(f"introspection ({event})")
            finally:
                state["busy"] = False

    def pre_run_cell(info):
        restore()
        raw = info.raw_cell or ""
        state["test"] = hashlib.sha256(raw.encode()).hexdigest() in tests
        if state["test"]:
            clear_caches()
        state["file"] = ip.compile.get_code_name(raw, raw, ip.execution_count)
        state["tamper"] = []

    def post_run_cell(result):
        if not state["test"]:
            return
        why = list(state["tamper"])
        why += [f"{mod.__name__}.{name} replaced" for mod, name, fn in expected if getattr(mod, name, None) is not fn]
        why += [f"builtins.{k} replaced" for k, v in real_builtins.items() if vars(builtins).get(k) is not v]
        why += [f"{name} replaced" for name in instrument_changes(fix=False)]
        if vars(builtins).get("__grader_cmp__") is not grader_cmp or "__grader_cmp__" in ip.user_ns:
            why.append("comparison helper replaced")
        state["test"] = False
        restore()
        # the pipeline checks an error output is there: a custom exception handler or a patched
        # showtraceback must not turn a failed test into a silent pass
        error = result.error_in_exec or result.error_before_exec
        if why:
            verdict = "tamper: " + "; ".join(why[:5])
        elif error is not None:
            verdict = f"error: {type(error).__name__}"
        else:
            verdict = "ok"
        out.write(f"\n{nonce} {verdict}\n")
        out.flush()

    ip.ast_transformers.append(TestCellsOnly())
    ip.events.register("pre_run_cell", pre_run_cell)
    ip.events.register("post_run_cell", post_run_cell)
    sys.addaudithook(audit)
    restore()
    del threading


_grader_guard()
del _grader_guard
