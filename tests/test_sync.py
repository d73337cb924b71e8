"""The sync check passes on the repository and fails on each way the three forms can drift apart.

Every stale case is made on a scratch copy (nbs/, pith_lit/, settings.ini, scripts/), never on the tree.
"""
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

NEW_NB = """# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %%
#| default_exp scratch_module

# %%
#| export
def answer(): return 42
"""


def run_check(root: Path):
    return subprocess.run([sys.executable, str(root / "scripts" / "sync_check.py"), str(root)],
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for sub in ("nbs", "pith_lit"):
        for p in sorted((root / sub).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode()); h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def scratch(tmp_path):
    for sub in ("nbs", "pith_lit", "scripts"):
        shutil.copytree(ROOT / sub, tmp_path / sub, ignore=shutil.ignore_patterns("__pycache__", "runs"))
    shutil.copy(ROOT / "settings.ini", tmp_path / "settings.ini")
    assert run_check(tmp_path).returncode == 0
    return tmp_path


def a_notebook(root: Path) -> Path:
    return sorted((root / "nbs" / "models").glob("2*.py"))[0]


def test_repository_in_sync_and_untouched():
    before = tree_digest(ROOT)
    proc = run_check(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert tree_digest(ROOT) == before, "the sync check modified the work tree"


def test_py_edited_alone(scratch):
    py = a_notebook(scratch)
    py.write_text(py.read_text() + "\n# %%\n#| export\nEXTRA = 1\n")
    proc = run_check(scratch)
    assert proc.returncode == 1 and py.with_suffix(".ipynb").name in proc.stdout


def test_markdown_edited_in_py_alone(scratch):
    py = a_notebook(scratch)
    py.write_text(py.read_text() + "\n# %% [markdown]\n# A new paragraph.\n")
    proc = run_check(scratch)
    assert proc.returncode == 1 and "differs" in proc.stdout


def test_ipynb_edited_alone(scratch):
    nb_path = a_notebook(scratch).with_suffix(".ipynb")
    nb = json.loads(nb_path.read_text())
    code = next(c for c in nb["cells"] if c["cell_type"] == "code" and "#| export" in "".join(c["source"]))
    code["source"] = "".join(code["source"]) + "\nEDITED_IN_JUPYTER = True"
    nb_path.write_text(json.dumps(nb, indent=1))
    proc = run_check(scratch)
    assert proc.returncode == 1 and nb_path.name in proc.stdout


def test_forgotten_export(scratch):
    py = a_notebook(scratch)
    py.write_text(py.read_text() + "\n# %%\n#| export\nFORGOTTEN = 1\n")
    subprocess.run([sys.executable, "-m", "jupytext", "--quiet", "--to", "ipynb", "--update", str(py)],
                   check=True, env=subprocess_env())
    proc = run_check(scratch)
    assert proc.returncode == 1 and "pith_lit/" in proc.stdout and "differs" in proc.stdout


def test_new_notebook_without_pair(scratch):
    (scratch / "nbs" / "99_scratch.py").write_text(NEW_NB)
    proc = run_check(scratch)
    assert proc.returncode == 1 and "99_scratch.py has no .ipynb pair" in proc.stdout


def test_new_ipynb_without_py(scratch):
    py = scratch / "nbs" / "99_scratch.py"
    py.write_text(NEW_NB)
    subprocess.run([sys.executable, "-m", "jupytext", "--quiet", "--to", "ipynb", str(py)], check=True,
                   env=subprocess_env())
    py.unlink()
    proc = run_check(scratch)
    assert proc.returncode == 1 and "99_scratch.ipynb has no .py pair" in proc.stdout


def test_new_notebook_without_module(scratch):
    py = scratch / "nbs" / "99_scratch.py"
    py.write_text(NEW_NB)
    subprocess.run([sys.executable, "-m", "jupytext", "--quiet", "--to", "ipynb", str(py)], check=True,
                   env=subprocess_env())
    proc = run_check(scratch)
    assert proc.returncode == 1 and "pith_lit/scratch_module.py is missing" in proc.stdout


def test_hand_written_module(scratch):
    (scratch / "pith_lit" / "by_hand.py").write_text("X = 1\n")
    proc = run_check(scratch)
    assert proc.returncode == 1 and "pith_lit/by_hand.py is not produced" in proc.stdout
