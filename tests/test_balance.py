"""Balancing routing beyond its notebooks (nbs/train/42_load_balance.py, the routers of nbs/models/21-23): the
sequence-level loss at other sizes, the selection bias in all three families (choice only, never the weights), the
bias update, round-robin routing through the trainer, and the bias under expert and pipeline parallelism (2 gloo
processes) against one process, read back from the checkpoints."""
import json
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import ROOT, subprocess_env
from pith_lit.models import deepseek_v2, gpt_oss, qwen3_moe
from pith_lit.models.protocol import Options
from pith_lit.train import checkpoint
from pith_lit.train.config import load_config
from pith_lit.train.load_balance import LoadBalance, routers, update_bias
from pith_lit.train.trainer import build_model, train

QUIET = ["log.sample_tokens=0", "log.tensorboard=false"]
SMALL = ["train.steps=4", "train.warmup=1", "train.global_batch=8", "train.micro_batch=2", "train.seq_len=32",
         "train.dtype=float64", "train.lb_coef=0", "train.lb_bias_rate=0.01", "ckpt.every=0", *QUIET]


# ------------------------------------------------------------------------------------- sequence-level loss

@pytest.mark.parametrize("B,S,E,k", [(1, 7, 4, 1), (4, 6, 8, 3)])
def test_sequence_level_is_the_mean_over_sequences(B, S, E, k):
    g = torch.Generator().manual_seed(B * 100 + S)
    logits = torch.randn(B * S, E, dtype=torch.float64, generator=g)
    logits[:S, 0] += 3.0                                   # the first sequence leans on expert 0
    probs = logits.softmax(-1).requires_grad_()
    ids = probs.detach().topk(k, -1).indices
    out = LoadBalance(E, 0.2, "sequence", seq_len=S).loss(7, probs, ids)
    out.backward()
    ref, grad = 0.0, torch.zeros(B * S, E, dtype=torch.float64)
    for b in range(B):                                     # straight from the definition, per sequence
        rows = slice(b * S, (b + 1) * S)
        f = torch.bincount(ids[rows].flatten(), minlength=E).double() / (S * k)
        ref += 0.2 * E * (f * probs.detach()[rows].mean(0)).sum() / B
        grad[rows] = 0.2 * E * f / (S * B)
    assert torch.allclose(out, ref, rtol=1e-12) and torch.allclose(probs.grad, grad, rtol=1e-12)
    with pytest.raises(ValueError, match="not whole sequences of 5"):
        LoadBalance(E, 0.2, "sequence", seq_len=5).loss(0, probs, ids)


# ------------------------------------------------------------------------------------------- the routers

FAMILIES = {
    "qwen3_moe": (qwen3_moe.Config(vocab_size=32, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=8,
                                   num_experts_per_tok=2), "probs"),
    "deepseek_v2": (deepseek_v2.Config(vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                       n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=8, qk_nope_head_dim=4,
                                       qk_rope_head_dim=4, v_head_dim=4, first_k_dense_replace=1), "probs"),
    "gpt_oss": (gpt_oss.Config(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=8,
                               num_experts_per_tok=2), "logits"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bias_moves_the_choice_not_the_weights(family):
    """In every family: the bias starts at zero; a bias that favours expert 7 for every token sends every token there,
    while each chosen expert's weight is what the unbiased router gives it (the routers' weights are a function of
    the probabilities or logits at the chosen ids, checked against routing with the bias forced into the ids)."""
    cfg, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = build_model(cfg).double()
    found = routers(model)
    assert list(found) == (["1"] if family == "deepseek_v2" else ["0", "1"])   # DeepSeek's layer 0 is dense
    router = found["1"]
    assert torch.equal(router.e_score_correction_bias, torch.zeros(8, dtype=torch.float64))
    x = torch.randn(12, 16, dtype=torch.float64)
    plain = router(x)
    with torch.no_grad():
        router.e_score_correction_bias[7] = 1e3
    biased = router(x)
    assert (biased.ids == 7).any(-1).all() and not (plain.ids == 7).any(-1).all()
    assert torch.equal(biased.probs, plain.probs)
    # the weights of a token whose choice did not change are unchanged
    same = (biased.ids.sort(-1).values == plain.ids.sort(-1).values).all(-1)
    order = lambda r: r.weights.gather(1, r.ids.argsort(-1))
    assert torch.allclose(order(biased)[same], order(plain)[same])
    torch.manual_seed(0)
    rr = routers(build_model(cfg, Options(route="round_robin")).double())["1"](x)
    assert torch.bincount(rr.ids.flatten(), minlength=8).tolist() == [3] * 8


def test_update_bias_follows_the_sign_of_the_load():
    cfg, _ = FAMILIES["qwen3_moe"]
    model = build_model(cfg)
    counts = torch.tensor([5.0, 3, 3, 3, 1, 1, 0, 8], dtype=torch.float64)          # mean 3
    totals = {"0": torch.stack([counts, counts]), "1": torch.stack([counts.flip(0), counts])}
    update_bias(routers(model), totals, 0.5)
    update_bias(routers(model), totals, 0.25)
    step = torch.tensor([-1.0, 0, 0, 0, 1, 1, 1, -1]) * 0.75
    assert torch.equal(routers(model)["0"].e_score_correction_bias, step)
    assert torch.equal(routers(model)["1"].e_score_correction_bias, step.flip(0))


# ---------------------------------------------------------------------------------------- through the trainer

def test_round_robin_run_is_perfectly_balanced(tmp_path):
    over = ["train.steps=2", "train.warmup=0", "train.global_batch=4", "train.seq_len=32", "ckpt.every=-1",
            "train.route=round_robin", *QUIET]
    out = train(load_config(overrides=over + [f"run.dir={tmp_path}"]), quiet=True)
    assert [r["balance"] for r in out["history"]] == [1.0, 1.0]


def ckpt_biases(run_dir, tmp_path) -> dict:
    "The routers' biases in the newest checkpoint of `run_dir`, by name."
    dest = tmp_path / f"{run_dir.name}.pt"
    dcp_to_torch_save(checkpoint.latest(run_dir), dest)
    state = torch.load(dest, weights_only=False)
    return {k: v for k, v in state["model"].items() if k.endswith("e_score_correction_bias")}


def test_bias_is_trained_and_checkpointed(tmp_path):
    """With lb_bias_rate the biases move (multiples of the rate), are saved, and a run resumed from step 2 repeats
    the straight run's losses exactly, which it could not if the bias were lost."""
    straight = train(load_config(overrides=SMALL + [f"run.dir={tmp_path}/a"]), quiet=True)
    model_biases = {k: v for k, v in straight["model"].state_dict().items() if k.endswith("e_score_correction_bias")}
    saved = ckpt_biases(tmp_path / "a", tmp_path)
    assert saved.keys() == model_biases.keys() and len(saved) == 4
    for k, v in saved.items():
        assert torch.equal(v, model_biases[k]) and v.abs().max() > 0
        assert torch.allclose(v / 0.01, (v / 0.01).round(), atol=1e-9)         # 4 steps of ±0.01 or 0
    split = load_config(overrides=SMALL + [f"run.dir={tmp_path}/b", "ckpt.every=2"])
    losses = [r["loss"] for r in train(split, until=2, quiet=True)["history"] + train(split, quiet=True)["history"]]
    assert losses == [r["loss"] for r in straight["history"]]


@pytest.mark.parametrize("layout", [["parallel.ep=2"], ["parallel.pp=2"]], ids=["ep2", "pp2"])
def test_bias_under_parallelism_matches_one_process(tmp_path, layout):
    """2 gloo processes (ep 2: each rank half the experts and half the batch, counts summed over both; pp 2: each
    rank two of the four layers) against one process: after 4 steps every router's bias is the same, and so is the
    loss curve (float64)."""
    single = train(load_config(overrides=SMALL + [f"run.dir={tmp_path}/one"]), quiet=True)["history"]
    over = SMALL + layout + [f"run.dir={tmp_path}/two"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "pith_lit.train", *[a for o in over for a in ("--set", o)]]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(two, single):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9), (a["step"], a["loss"], b["loss"])
    one_b, two_b = ckpt_biases(tmp_path / "one", tmp_path), ckpt_biases(tmp_path / "two", tmp_path)
    assert one_b.keys() == two_b.keys() and len(one_b) == 4
    for k in one_b:
        assert torch.equal(one_b[k], two_b[k]), (k, one_b[k], two_b[k])
    assert any(v.abs().max() > 0 for v in one_b.values())
