"""Each validation notebook, executed by papermill with its default (small, CPU) parameters (those README.md runs are
left to tests/test_readme.py).

The notebook must end by printing PASS; a failing check raises, which makes papermill fail. The executed
notebook is written under the pytest temporary directory for inspection.
"""
import re
import subprocess
import sys

import pytest

from conftest import NBS, ROOT, subprocess_env
from test_readme import README, blocks

# A notebook that README.md runs (tests/test_readme.py runs its blocks as written, and papermill fails the block on
# FAIL) is not run a second time here.
RUN_BY_README = {name for b in blocks(README.read_text()) if b.lang == "bash" and not b.skip
                 for name in re.findall(r"nbs/validate/(v\w+)\.py", b.code)}
VALIDATIONS = [p for p in sorted((NBS / "validate").glob("v*.py")) if p.stem not in RUN_BY_README]


def test_the_readme_runs_a_validation_notebook():
    "The notebooks left out above are run by test_readme; this fails if the README stops running any."
    assert RUN_BY_README and RUN_BY_README <= {p.stem for p in (NBS / "validate").glob("v*.py")}, RUN_BY_README


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
