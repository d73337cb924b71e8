"""Context parallelism (ops/17 ring attention over zigzag chunks) on 2 and 4 CPU processes (gloo) against one
process: two AdamW steps in float64, the loss, every gradient, the clipped norm and every parameter compared
(`python -m pith_lit.testing fsdp --cp N`), with packed documents that cross the chunks (an odd number per row, some
of one token); then the trainer at cp 2 against one process."""
import pytest

from conftest import ROOT
from test_fsdp import fsdp_check
from test_trainer import QUIET, metrics, torchrun_train
from pith_lit.train.config import load_config
from pith_lit.train.trainer import train

ALL = "qwen3_moe deepseek_v2 gpt_oss"
LAYOUTS = [  # (processes, (pp, dp_replicate, dp, ep), cp, extra flags, families)
    (2, (1, 1, 1, 1), 2, ["--documents"], ALL),            # the ring of two, each attention kind
    (4, (1, 1, 1, 1), 4, ["--documents"], ALL),            # four ranks: steps with nothing visible, windows skipped
    (2, (1, 1, 1, 1), 2, [], "qwen3_moe"),                  # one sequence per row, (S,) positions
    (4, (1, 1, 1, 2), 2, ["--documents"], "deepseek_v2"),  # cp 2 × ep 2: the cp ranks are data ranks for the experts
    (4, (2, 1, 1, 1), 2, ["--documents"], "gpt_oss"),      # cp 2 × pp 2: DualPipeV with rings in its stages
    (4, (1, 1, 2, 1), 2, ["--documents"], "qwen3_moe"),    # cp 2 × FSDP dp 2: dense weights sharded over dp × cp
    (2, (1, 1, 1, 1), 2, ["--documents", "--overlap"], "deepseek_v2"),  # the overlapped schedule at pp 1
]


@pytest.mark.parametrize("n,layout,cp,extra,families", LAYOUTS,
                         ids=["cp2", "cp4", "cp2-no-documents", "cp2-ep2", "cp2-pp2", "cp2-dp2", "cp2-overlap"])
def test_context_parallel_against_one_process(n, layout, cp, extra, families):
    lines = fsdp_check(n, layout, "--cp", str(cp), *extra, families=families)
    assert all(f"cp={cp}" in line for line in lines)


def test_trainer_cp2_matches_one_process(tmp_path):
    """`parallel.cp = 2` under torchrun: both processes read the same micro-batches and keep their zigzag chunks of
    each; with packed documents and the load-balance loss on, the loss curve, gradient norm and balance equal one
    process's (float64, so only the order of additions differs), and so does the greedy sample the two ranks decode
    together over the ring."""
    over = ["train.steps=5", "train.warmup=1", "ckpt.every=-1", "train.dtype=float64", "train.seq_len=32",
            "data.document_mask=true", *QUIET, "log.sample_tokens=7"]
    out = train(load_config(overrides=over + [f"run.dir={tmp_path}/one"]), quiet=True)
    single = out["history"]
    proc = torchrun_train(2, over + [f"run.dir={tmp_path}/cp2", "parallel.cp=2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert out["sample"] and f"sample: {out['sample']!r}" in proc.stdout, (out["sample"], proc.stdout[-2000:])
    cp2 = metrics(tmp_path / "cp2")
    assert [r["step"] for r in cp2] == [r["step"] for r in single] == list(range(1, 6))
    for a, b in zip(cp2, single):
        for key in ("loss", "grad_norm", "lb_loss", "balance"):
            assert a[key] == pytest.approx(b[key], rel=1e-9), (a["step"], key, a[key], b[key])
