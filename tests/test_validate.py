"""Each validation notebook, executed by papermill with its default (small, CPU) parameters.

The notebook must end by printing PASS; a failing check raises, which makes papermill fail. The executed
notebook is written under the pytest temporary directory for inspection.
"""
import subprocess
import sys

import pytest

from conftest import NBS, ROOT, subprocess_env

VALIDATIONS = sorted((NBS / "validate").glob("v*.py"))


@pytest.mark.parametrize("nb", VALIDATIONS, ids=[p.stem for p in VALIDATIONS])
def test_validation(nb, tmp_path):
    out = tmp_path / f"{nb.stem}.out.ipynb"
    code = ("import jupytext, papermill, sys; "
            "papermill.execute_notebook(jupytext.read(sys.argv[1]), sys.argv[2], cwd=sys.argv[4], "
            "parameters={'out_dir': sys.argv[3]}, kernel_name='python3', progress_bar=False)")
    proc = subprocess.run([sys.executable, "-c", code, str(nb), str(out), str(tmp_path), str(nb.parent)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{nb.name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert "PASS" in out.read_text(), f"{nb.name} did not print PASS"
