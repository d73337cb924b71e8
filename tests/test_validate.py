"""Each validation notebook, executed by papermill with its default (small, CPU) parameters (those README.md runs are
left to tests/test_readme.py).

The notebook must end by printing PASS; a failing check raises, which makes papermill fail. The executed
notebook is written under the pytest temporary directory for inspection.
"""
import json
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


def run_validation(nb, tmp_path, **params) -> str:
    "Execute a validation notebook with papermill (out_dir and `params` set); returns the executed notebook's text."
    out = tmp_path / f"{nb.stem}.out.ipynb"
    code = ("import json, jupytext, papermill, sys; "
            "papermill.execute_notebook(jupytext.read(sys.argv[1]), sys.argv[2], cwd=sys.argv[4], "
            "parameters={'out_dir': sys.argv[3], **json.loads(sys.argv[5])}, kernel_name='python3', "
            "progress_bar=False)")
    proc = subprocess.run([sys.executable, "-c", code, str(nb), str(out), str(tmp_path), str(nb.parent),
                           json.dumps(params)], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{nb.name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    text = out.read_text()
    assert "PASS" in text, f"{nb.name} did not print PASS"
    return text


@pytest.mark.parametrize("nb", VALIDATIONS, ids=[p.stem for p in VALIDATIONS])
def test_validation(nb, tmp_path):
    run_validation(nb, tmp_path)


def test_fp8_validation_runs(tmp_path):
    """v05 with two runs of each recipe, the FP8 runs first: the rounds alternate their order, and on the CPU, with
    the same thread count, identical runs repeat bitwise (spread 0, so the margin stays max_gap). A second execution
    with no runs of its own pools the first's runs (runs_from) into the same verdict."""
    params = dict(steps=8, tail=4, warm=2, scalings=["rows"], overrides=[
        "model.num_hidden_layers=2", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=8",
        "train.warmup=2", "log.eval_every=0"])
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    text = run_validation(NBS / "validate" / "v05_fp8.py", tmp_path / "a", runs=2, fp8_first=True, **params)
    order = re.findall(r"round (\d): ([\w ,]+) trained", text)
    assert order == [("1", "FP8, row scales"), ("1", "unquantized"), ("2", "unquantized"), ("2", "FP8, row scales")]
    assert "2 unquantized runs, training loss" in text and "0.00% apart" in text, text[-3000:]
    # identical runs: each recipe's two runs report the same end loss, and the standard error is zero
    ends = re.findall(r"(unquantized|FP8, row scales) (\d): loss [\d.]+ -> ([\d.]+)", text)
    by = {}
    for name, _, end in ends:
        by.setdefault(name, set()).add(end)
    assert len(ends) == 4 and all(len(v) == 1 for v in by.values()), ends
    verdict = re.findall(r"(?:ok  |FAIL) FP8, row scales: [^\"\\]*", text)
    assert len(verdict) == 3 and len(re.findall(r"over 2 and 2 runs, 2 s.e. 0.00%, margin (3.00|10.00)%",
                                                 " ".join(verdict))) == 2, verdict
    pooled = run_validation(NBS / "validate" / "v05_fp8.py", tmp_path / "b", runs=0, runs_from=[str(tmp_path / "a")],
                            **params)
    assert not re.findall(r"round \d: [\w ,]+ trained", pooled), "runs = 0 trains nothing"
    assert re.findall(r"(?:ok  |FAIL) FP8, row scales: [^\"\\]*", pooled) == verdict
