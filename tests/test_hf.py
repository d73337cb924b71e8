"""Hugging Face checkpoints against transformers 5.x (pith_lit.train.hf, pith_lit.convert, weights-only checkpoints).

For each model family: a tiny random model built by transformers and written with its `save_pretrained` is read
with `load_hf`; logits and the gradients of a loss agree with transformers' in float32 and float64; `save_hf`
writes it back (sharded for some cases) and transformers' `from_pretrained` reads identical weights and computes
identical logits. End to end: hf2pith, two training steps whose first loss is transformers' loss on that batch,
pith2hf. transformers is imported only here (a test-only dependency).
"""
import json
import subprocess
import sys

import pytest
import torch
from pith_lit.engine.fsdp import whole
import torch.nn.functional as F

from conftest import ROOT, subprocess_env
from pith_lit import load_hf, save_hf
from pith_lit.convert import main as convert
from pith_lit.tokenize import tokenize_files
from pith_lit.train import checkpoint
from pith_lit.train.config import load_config, to_dict
from pith_lit.train.data import build_dataset
from pith_lit.train.hf import config_from_hf, config_to_hf
from pith_lit.train.trainer import build_model, train

transformers = pytest.importorskip("transformers")
EAGER = dict(attn_implementation="eager", experts_implementation="eager")  # eager experts also run in float64


def assert_close(a, b, rel, what=""):
    "max |a - b| within `rel` of max |b|."
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= rel * scale, f"{what}: max difference {err:.3g} > {rel:g} x max {scale:.3g}"


def qwen3_moe(**over):
    "Dense layer 1 between MoE layers, a tied head, attention biases, renormalised top-2 of 4."
    return transformers.Qwen3MoeConfig(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}), **over}, **EAGER)


def deepseek_v2(grouped: bool):
    "Dense first layer; greedy routing with one q_proj, or group-limited routing with the low-rank query and YaRN."
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  num_experts_per_tok=3, first_k_dense_replace=1, kv_lora_rank=12, qk_nope_head_dim=6,
                  qk_rope_head_dim=4, v_head_dim=5, max_position_embeddings=128)
    if not grouped:
        return transformers.DeepseekV2Config(**common, q_lora_rank=None, topk_method="greedy",
                                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, **EAGER)
    yarn = dict(rope_type="yarn", rope_theta=10_000.0, factor=8.0, original_max_position_embeddings=16,
                beta_fast=16, beta_slow=2, mscale=1.0, mscale_all_dim=0.5)
    return transformers.DeepseekV2Config(**common, q_lora_rank=10, topk_method="group_limited_greedy", n_group=4,
                                         topk_group=2, routed_scaling_factor=2.0, rope_parameters=yarn, **EAGER)


def gpt_oss():
    "A 4-token sliding window on alternate layers; the sequences below are longer."
    return transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=4, **EAGER)


def qwen3_5_moe(**over):
    "Linear and full attention layers, partial RoPE, two value heads per key head, a shared expert, a tied head."
    return transformers.Qwen3_5MoeTextConfig(**{**dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
        "linear_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, tie_word_embeddings=True), **over}, **EAGER)


CASES = {"qwen3_moe": (qwen3_moe, 5_000_000_000), "deepseek_v2-greedy": (lambda: deepseek_v2(False), 5_000_000_000),
         "deepseek_v2-grouped": (lambda: deepseek_v2(True), 40_000), "gpt_oss": (gpt_oss, 40_000),
         "qwen3_5_moe-text": (qwen3_5_moe, 40_000)}


def hf_model(hf_cfg, seed=0):
    "transformers' model with every weight random (its init leaves norms at 1 and biases at 0)."
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def weighted_sum(logits):
    return (logits * torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view_as(logits)).sum()


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_transformers(case, tmp_path):
    make, shard_bytes = CASES[case]
    hf = hf_model(make())
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, hf.config.vocab_size, (2, 9))
    # transformers computes norms, RoPE and the router in float32 even in a float64 model, so float64 agrees only
    # to float32's rounding (measured: logits within 8e-7, gradients within 1.1e-6 of the largest, both dtypes).
    # Qwen3.5's linear-attention layers run their gated delta rule in float32 too (it casts q, k, v, beta and the
    # decay), which leaves float64 gradients within 1.3e-5 of the largest (measured, transformers 5.23 and 5.24)
    grel64 = 4e-5 if case.startswith("qwen3_5") else 1e-5
    for dtype, rel, grel in ((torch.float32, 1e-5, 1e-4), (torch.float64, 4e-6, grel64)):
        ours, theirs = load_hf(tmp_path / "hf", dtype), hf.to(dtype)
        assert config_to_hf(ours.config)["model_type"] == theirs.config.model_type
        logits, ref = ours(ids)[0], theirs(input_ids=ids).logits
        assert logits.dtype == dtype
        assert_close(logits, ref, rel, f"{dtype} logits")
        params = dict(ours.named_parameters())
        hf_params = dict(theirs.named_parameters())
        assert params.keys() == hf_params.keys()
        g = torch.autograd.grad(weighted_sum(logits), list(params.values()))
        g_hf = torch.autograd.grad(weighted_sum(ref), [hf_params[n] for n in params])
        for name, a, b in zip(params, g, g_hf):
            assert_close(a, b, grel, f"{dtype} grad of {name}")

    ours, hf = load_hf(tmp_path / "hf"), hf.float()
    save_hf(ours, tmp_path / "ours", max_shard_bytes=shard_bytes)
    sharded = (tmp_path / "ours/model.safetensors.index.json").exists()
    assert sharded == (shard_bytes < 1e9) and len(list((tmp_path / "ours").glob("*.safetensors"))) > sharded
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", **EAGER)
    assert type(back) is type(hf) and back.dtype == torch.float32
    theirs, again = hf.state_dict(), back.state_dict()
    assert theirs.keys() == again.keys() and all(torch.equal(theirs[k], again[k]) for k in theirs)
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_matches_transformers_qwen3_5_moe_multimodal(tmp_path, capsys):
    """The published Qwen3.5-MoE checkpoints are the multimodal model: its language model is read (keys under
    model.language_model.), the vision tower and a multi-token-prediction tensor are read past with one line, the
    logits and gradients are transformers' own on text, and save_hf writes the text model."""
    from safetensors.torch import save_file
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    cfg = transformers.Qwen3_5MoeConfig(text_config=qwen3_5_moe(tie_word_embeddings=False).to_dict(),
                                        vision_config=vision, tie_word_embeddings=False, **EAGER)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    save_file({"mtp.fc.weight": torch.zeros(2, 2)}, tmp_path / "hf/mtp.safetensors")
    ours = load_hf(tmp_path / "hf")
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "vision tower (model.visual.*)" in said and "mtp.*), 1 tensors" in said
    assert ours.config.model_type == "qwen3_5_moe" and not ours.config.tie_word_embeddings
    ids = torch.randint(0, 64, (2, 9))
    logits, ref = ours(ids)[0], hf(input_ids=ids).logits
    assert_close(logits, ref, 1e-5, "logits")
    hf_params = dict(hf.named_parameters())
    params = {n: p for n, p in ours.named_parameters()}
    theirs = [hf_params[n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n]
              for n in params]
    g = torch.autograd.grad(weighted_sum(logits), list(params.values()))
    g_hf = torch.autograd.grad(weighted_sum(ref), theirs)
    for name, a, b in zip(params, g, g_hf):
        assert_close(a, b, 1e-4, f"grad of {name}")
    save_hf(ours, tmp_path / "ours")
    written = json.loads((tmp_path / "ours/config.json").read_text())
    assert written["model_type"] == "qwen3_5_moe_text" and written["architectures"] == ["Qwen3_5MoeForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", **EAGER)
    assert type(back) is transformers.Qwen3_5MoeForCausalLM
    with torch.no_grad():
        assert_close(back(input_ids=ids).logits, ref, 1e-6, "text model written by save_hf")


def test_config_json_of_transformers(tmp_path):
    "What transformers 5.x writes (nulls, rope_parameters, num_local_experts, derived head widths) maps to our config."
    hf = hf_model(deepseek_v2(False))
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["q_lora_rank"] is None and "rope_parameters" in written and "qk_head_dim" in written
    cfg = config_from_hf(written)
    assert (cfg.q_lora_rank, cfg.rope_scaling, cfg.n_group, cfg.kv_lora_rank) == (0, {}, 1, 12)
    written = json.loads(qwen3_moe().to_json_string())  # what save_pretrained writes
    assert "num_local_experts" in written and "num_experts" not in written
    cfg = config_from_hf(written)
    assert (cfg.num_experts, cfg.head_dim, cfg.tie_word_embeddings, cfg.rope_theta) == (4, 8, True, 10_000.0)


def tiny_run(tmp_path, hf) -> list[str]:
    "hf2pith of transformers' model `hf` into tmp_path/run; a small byte corpus; the overrides that train on it."
    hf.save_pretrained(tmp_path / "hf")
    convert(["hf2pith", str(tmp_path / "hf"), str(tmp_path / "run")])
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
    tokenize_files([tmp_path / "text.txt"], tmp_path / "corpus")
    return [f"run.dir={tmp_path / 'run'}", f"data.corpus={tmp_path / 'corpus'}", "train.steps=2", "train.warmup=0",
            "train.global_batch=2", "train.micro_batch=2", "train.seq_len=16", "log.tensorboard=false",
            "log.sample_tokens=0"]


def test_hf2pith_train_pith2hf(tmp_path):
    "hf2pith, then the command lines: python -m pith_lit.train on the run directory and pith_lit.convert pith2hf."
    hf = hf_model(qwen3_moe(vocab_size=260, tie_word_embeddings=False))  # the byte tokenizer's 259 ids fit
    over = tiny_run(tmp_path, hf)
    run = lambda *args: subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=subprocess_env(),
                                       capture_output=True, text=True, timeout=300)
    trained = run("pith_lit.train", str(tmp_path / "run/config.toml"), *[a for o in over for a in ("--set", o)])
    assert trained.returncode == 0, trained.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2
    data, _ = build_dataset(str(tmp_path / "corpus"), "bytes", tmp_path / "cache", 16, 0, 0, 1, 260)
    x, y = data.batch(0, 0, 2, 1)
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(losses[0] - hf_loss) < 1e-5 * hf_loss, (losses, hf_loss)

    exported = run("pith_lit.convert", "pith2hf", str(tmp_path / "run"), str(tmp_path / "out"))
    assert exported.returncode == 0 and f"wrote {tmp_path / 'out'}" in exported.stdout, exported.stderr[-3000:]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", **EAGER)
    cfg = load_config(tmp_path / "run/config.toml")
    model = build_model(cfg.model)
    last = checkpoint.latest(tmp_path / "run")
    assert checkpoint.load_weights(last, model=model, model_config=to_dict(cfg)["model"]) == 2
    mine, theirs = model.state_dict(), back.state_dict()
    biases = {k for k in mine if k.endswith(".e_score_correction_bias")}   # ours only, zero: not written (train/46)
    assert biases and all(not mine[k].any() for k in biases) and not biases & theirs.keys()
    mine = {k: v for k, v in mine.items() if k not in biases}
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not torch.equal(theirs["lm_head.weight"], hf.state_dict()["lm_head.weight"])  # trained, not imported


def test_imported_run_refuses_another_model(tmp_path):
    "The weights-only checkpoint is checked against [model] like any other, before anything is loaded."
    over = tiny_run(tmp_path, hf_model(qwen3_moe(vocab_size=260)))
    with pytest.raises(ValueError) as e:
        train(load_config(tmp_path / "run/config.toml", over + ["model.num_experts=8"]), quiet=True)
    msg = str(e.value)
    assert "step_00000000 does not match this run" in msg and "config num_experts: checkpoint 4, this run 8" in msg
    assert "parameter model.layers.0.mlp.gate.weight: checkpoint shape [4, 32], this run [8, 32]" in msg
    assert not (tmp_path / "run/metrics.jsonl").exists()


def test_imported_run_with_fp32_masters(tmp_path):
    """bf16 compute with fp32 masters: after a step at a tiny learning rate the weights (FSDP2's fp32 shards, gathered
    here) are still the imported ones, exactly: the masters were never rounded to bf16."""
    hf = hf_model(qwen3_moe(vocab_size=260))
    over = tiny_run(tmp_path, hf) + ["train.dtype=bfloat16", "train.optim_dtype=float32", "train.steps=1",
                                     "train.lr=1e-9"]
    model = train(load_config(tmp_path / "run/config.toml", over), quiet=True)["model"]
    imported = hf.state_dict()
    for name, p in model.state_dict().items():
        assert p.dtype == torch.float32, (name, p.dtype)
        if name.endswith(".e_score_correction_bias"):   # the routers' selection bias: ours, zero (train/42)
            assert not p.any(), name
            continue
        assert_close(whole(p), imported[name].float(), 1e-6, name)  # 1e-9 × one AdamW step, no bf16 rounding
