"""`python -m course`'s command line: a module run with -m gets every argument after its name, options included,
as `python -m pytest -q test_x.py` would give it."""
import json
import subprocess
import sys

from course import autostart

_ENV = {k: v for k, v in __import__("os").environ.items() if k != autostart.ENV}


def test_module_gets_its_own_options_after_its_name(tmp_path):
    (tmp_path / "echo_args.py").write_text(
        "import json, sys, torch\n"
        "print(json.dumps({'argv': sys.argv[1:], 'gpus': torch.cuda.device_count()}))\n")
    done = subprocess.run([sys.executable, "-m", "course", "--gpus", "2", "-m", "echo_args", "-q", "x.py", "-k",
                           "a", "--gpus", "7"], cwd=tmp_path, env=_ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"argv": ["-q", "x.py", "-k", "a", "--gpus", "7"], "gpus": 2}


def test_module_exit_status_is_the_programs(tmp_path):
    (tmp_path / "fails.py").write_text("raise SystemExit(3)\n")
    done = subprocess.run([sys.executable, "-m", "course", "-m", "fails", "-v"], cwd=tmp_path, env=_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr


def test_a_script_in_another_folder_finds_its_sibling_modules_as_under_python(tmp_path):
    """`python scripts/train.py` puts scripts/ first on sys.path, so `from model import Net` works; so must
    `python -m course scripts/train.py`, with the same absolute __file__."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "model.py").write_text("WIDTH = 7\n")
    (tmp_path / "scripts" / "train.py").write_text(
        "import json, sys\nfrom model import WIDTH\n"
        "print(json.dumps({'width': WIDTH, 'file': __file__, 'path0': sys.path[0]}))\n")
    results = []
    for command in ([sys.executable], [sys.executable, "-m", "course", "--gpus", "2"]):
        done = subprocess.run(command + ["scripts/train.py"], cwd=tmp_path, env=_ENV, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout.splitlines()[-1]))
    assert results[1] == results[0] == {"width": 7, "file": str(tmp_path / "scripts" / "train.py"),
                                        "path0": str(tmp_path / "scripts")}
