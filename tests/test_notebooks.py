"""One pytest item per exported/tutorial notebook: `nbdev_test --path NB` in a subprocess with a timeout.

Cells flagged `cuda`, `multigpu` or `slow` are skipped here (settings.ini `tst_flags`); the GPU machine runs
them with `nbdev_test --flags "cuda multigpu"`. Validation notebooks (nbs/validate) run through papermill in
test_validate.py instead.
"""
import subprocess

import pytest

from conftest import NBS, ROOT, bin_path, subprocess_env

NOTEBOOKS = sorted(p for p in NBS.rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts and "validate" not in p.relative_to(NBS).parts)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[str(p.relative_to(NBS)) for p in NOTEBOOKS])
def test_notebook(nb):
    proc = subprocess.run([bin_path("nbdev_test"), "--path", str(nb), "--do_print"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{nb.relative_to(ROOT)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
