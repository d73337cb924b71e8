"""Shared test setup: every subprocess gets the Triton interpreter, one CPU thread, and the repo root."""
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"
# The runs of the test session share one build of the embedded corpus's tokenizer and tokens (each run would
# otherwise train the BPE and tokenize 4 MB in its own run.dir/cache, about 4 s per process). Its names are hashes of
# the content, so a folder left by an earlier session is reused as it is.
os.environ.setdefault("PITH_LIT_CACHE", str(Path(tempfile.gettempdir()) / "pith_lit-test-cache"))


def subprocess_env(**extra) -> dict:
    """Environment for child processes: CPU-only Triton interpreter, one thread per process, no GPU."""
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               MPLBACKEND="Agg")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def bin_path(name: str) -> str:
    """A console script installed beside the running interpreter (the venv's nbdev_test, torchrun, ...)."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else name


@pytest.fixture
def env():
    return subprocess_env()


# Triton kernel tests under the interpreter: each group of checks runs in its own process (`python FILE GROUP`), since
# TRITON_INTERPRET=1 must be set before Triton is imported (test_ops_attention, test_ops_fp8, test_ops_gated_delta_rule).

def run_group(file: str, group: str, timeout: int = 300) -> None:
    "Run `group_<group>()` of test file `file` in a child process under the interpreter; fail with its output."
    import subprocess
    proc = subprocess.run([sys.executable, file, group], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"group {group} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def group_main(namespace: dict, groups: list[str]) -> None:
    "The child's side of `run_group`: call `group_<argv[1]>` from the test file's `namespace`."
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (the Triton checks need TRITON_INTERPRET=1)"
    group = sys.argv[1]
    if group not in groups:
        raise SystemExit(f"unknown group {group!r}; use one of {', '.join(groups)}")
    namespace[f"group_{group}"]()
    print(f"{group} OK")


# Checks shared by the model families' tests (test_qwen3_moe, test_deepseek_v2, test_gpt_oss).
def assert_close(a, b, rel, what=""):
    "max |a - b| within `rel` of max |b|: a tolerance that does not depend on the size of the values."
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= rel * scale, f"{what} max difference {err:.3g} > {rel:g} x max {scale:.3g}"


def weighted_sum(t):
    "A loss whose gradient differs for every output element."
    import torch
    return (t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum()


def assert_grads_match(model, logits, ref, grel) -> dict:
    "The parameter gradients through `logits` and through `ref` agree within `grel`; returns the former by name."
    import torch
    params = dict(model.named_parameters())
    g = torch.autograd.grad(weighted_sum(logits), list(params.values()))
    g_ref = torch.autograd.grad(weighted_sum(ref), list(params.values()))
    for name, a, b in zip(params, g, g_ref):
        assert_close(a, b, grel, f"grad of {name}")
    return dict(zip(params, g))


def assert_positions_used(model, vocab_size):
    "(S,) and (B, S) positions give the same result; positions are used (a different one changes the logits)."
    import torch
    ids = torch.randint(0, vocab_size, (2, 6))
    a, _ = model(ids, torch.arange(6))
    b, _ = model(ids, torch.arange(6).expand(2, 6))
    c, _ = model(ids, torch.tensor([[0, 1, 2, 3, 4, 5], [0, 2, 4, 6, 8, 10]]))
    assert torch.equal(a, b)
    assert torch.equal(a[0], c[0]) and not torch.allclose(a[1], c[1])
