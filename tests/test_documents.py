"""Packed documents: positions that restart at each document make every model family attend within documents,
so each document's logits in a packed row equal those of the document alone (float64 on the CPU, through the
SDPA-with-mask path; ops/14's kernel with documents is checked in tests/test_ops_attention.py)."""
import pytest
import torch

from pith_lit.models import deepseek_v2, gpt_oss, qwen3_moe
from pith_lit.ops.attention import documents

FAMILIES = {
    "qwen3_moe": lambda: qwen3_moe.Qwen3MoeForCausalLM(qwen3_moe.Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)),
    "deepseek_v2": lambda: deepseek_v2.DeepseekV2ForCausalLM(deepseek_v2.Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)),
    "gpt_oss": lambda: gpt_oss.GptOssForCausalLM(gpt_oss.Config(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_attend_within_themselves(family):
    torch.manual_seed(0)
    model = FAMILIES[family]().double()
    lengths = [5, 1, 7]
    ids = torch.randint(0, 64, (2, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    assert documents(positions)[0].tolist() == [0] * 5 + [1] + [2] * 7
    packed, _ = model(ids, positions)
    start = 0
    for n in lengths:
        alone, _ = model(ids[:, start:start + n])
        torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-10, atol=1e-10)
        start += n
    whole, _ = model(ids)                      # and one sequence: the later documents see the earlier ones
    assert not torch.allclose(whole[:, 5:], packed[:, 5:])


def test_trainer_restarts_positions_after_each_document_end():
    "data.document_mask: positions restart after the end-of-document token; off, a window is one sequence."
    from types import SimpleNamespace
    from pith_lit.train.trainer import positions_of
    ids = torch.tensor([[5, 6, 257, 7, 257, 257, 8], [1, 2, 3, 4, 5, 6, 7]])
    assert positions_of(SimpleNamespace(eos=None), ids).tolist() == list(range(7))
    assert positions_of(SimpleNamespace(eos=257), ids).tolist() == [[0, 1, 2, 0, 1, 0, 0], list(range(7))]


def test_training_with_document_mask(tmp_path):
    """A short run on short documents with data.document_mask trains (the loss falls) and differs from the same run
    without it."""
    import json
    from pith_lit.tokenize import tokenize_files
    from pith_lit.train.config import load_config
    from pith_lit.train.trainer import train
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "moe", "expert", "token", "route"]
    docs = [" ".join(words[i] for i in torch.randint(0, 8, (int(n),), generator=g)) for n in torch.randint(2, 8, (400,),
                                                                                                            generator=g)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenize_files([tmp_path / "docs.jsonl"], tmp_path / "docs")
    base = ["train.steps=8", "train.warmup=1", "log.tensorboard=false", "log.sample_tokens=0", "ckpt.every=-1",
            "train.global_batch=4", "train.seq_len=64", f"data.corpus={tmp_path / 'docs'}", "data.tokenizer=bytes"]
    on = train(load_config(overrides=base + [f"run.dir={tmp_path}/on", "data.document_mask=true"]), quiet=True)
    off = train(load_config(overrides=base + [f"run.dir={tmp_path}/off"]), quiet=True)
    a, b = [r["loss"] for r in on["history"]], [r["loss"] for r in off["history"]]
    assert a[-1] < a[0] - 0.5 and a != b
