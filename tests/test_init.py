"""Meta-device initialisation: a rank that builds the model on the meta device, keeps its pipeline stages and
expert slices, and only then allocates and initialises them holds bitwise the values the whole model has."""
import pytest
import torch

from conftest import ROOT
from pith_lit.engine.dualpipev import split_model
from pith_lit.engine.ep import is_expert_param, shard_experts
from pith_lit.train.config import load_config
from pith_lit.train.trainer import build_model

CONFIGS = ["tiny.toml", "tiny-deepseek-v2.toml", "tiny-gpt-oss.toml", "tiny-qwen3-5-moe.toml"]
# (pp rank, pp, ep rank, ep): an expert shard alone, a pipeline stage alone, both at once
CUTS = [(0, 1, 1, 2), (1, 2, 0, 1), (0, 2, 3, 4)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("pp_rank,pp,ep_rank,ep", CUTS)
def test_share_built_on_meta_equals_whole_model(config, pp_rank, pp, ep_rank, ep):
    mc = load_config(ROOT / "configs" / config).model
    if mc.num_hidden_layers < 2 * pp:
        pytest.skip(f"{config} has {mc.num_hidden_layers} layers, too few for pp {pp}")
    whole = build_model(mc)
    whole.init_weights(5)
    ref = dict(whole.named_parameters())
    with torch.device("meta"):
        part = build_model(mc)
    if pp > 1:
        split_model(part, pp_rank, pp)
    if ep > 1:
        shard_experts(part, ep_rank, ep)
    part.to_empty(device="cpu")
    part.init_weights(5)
    held = dict(part.named_parameters())
    assert 0 < sum(p.numel() for p in held.values()) < sum(p.numel() for p in ref.values())
    for name, p in held.items():
        want = ref[name]
        if is_expert_param(name) and ep > 1:
            n = p.shape[0]
            want = want[ep_rank * n:(ep_rank + 1) * n]
        assert torch.equal(p, want), f"{config}: {name} differs from the whole model's"


def test_seed_changes_the_values_and_default_follows_manual_seed():
    mc = load_config(ROOT / "configs" / "tiny.toml").model
    torch.manual_seed(5)
    a = build_model(mc)                      # init_weights() at construction, seeded by torch.initial_seed() = 5
    b = build_model(mc)
    b.init_weights(5)
    c = build_model(mc)
    c.init_weights(6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:                     # matrices are random; norms (1) and biases (0) are not
            assert not torch.equal(pa, pc), name
