"""The run config (pith_lit.train.config): every rejection says what was wrong, overrides parse by the field's
type, dump_toml round-trips, and every file in configs/ loads and validates at the world size it asks for."""
import math
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

from conftest import ROOT, subprocess_env
from pith_lit.models import qwen3_moe
from pith_lit.train.config import (BYTE_VOCAB, Config, ConfigError, MODEL_TYPES, dump_toml, from_dict, load_config,
                                   model_class, parse_args, to_dict, validate)

CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def error(overrides, world_size=1, data=None) -> str:
    "The message of the ConfigError that the default config with these overrides must raise."
    with pytest.raises(ConfigError) as e:
        validate(from_dict(data or {}, overrides), world_size)
    return str(e.value)


# ---- one test per rejection -------------------------------------------------------------------------------

def test_unknown_section_suggests_closest():
    assert error([], data={"trian": {"lr": 1e-3}}) == "[trian]: no such section; did you mean [train]?"
    assert error(["paralel.dp=2"]) == "[paralel]: no such section; did you mean [parallel]?"
    msg = error(["zzz.a=1"])
    assert msg.startswith("[zzz]: no such section; valid: run, model, parallel, train, data, ckpt, log"), msg


def test_unknown_field_suggests_closest():
    assert error([], data={"train": {"lrr": 0.1}}) == \
        "train.lrr = 0.1: no such field in [train]; did you mean train.lr?"
    assert error(["model.num_expert=4"]) == \
        "model.num_expert = 4: no such field in [model]; did you mean model.num_experts?"


def test_unknown_model_type_names_valid_ones():
    assert error(["model.model_type=llama"]) == "model.model_type = 'llama': unknown model family; valid: 'qwen3_moe', 'deepseek_v2', 'gpt_oss', 'qwen3_5_moe'"
    assert error([], data={"model": {"model_type": "gpt2"}}).startswith("model.model_type = 'gpt2'")
    for t in MODEL_TYPES:  # every listed name is a case of the match, and its dataclass agrees
        assert model_class(t)().model_type == t


def test_wrong_type():
    assert error(["train.steps=1.5"]) == "train.steps = 1.5: expected int, got float"
    assert error(["train.lr=fast"]) == "train.lr = 'fast': expected float, got str"
    assert error([], data={"train": {"steps": "many"}}) == "train.steps = 'many': expected int, got str"
    assert error(["model.num_hidden_layers=true"]) == "model.num_hidden_layers = True: expected int, got bool"
    assert error(["log.tensorboard=1"]) == "log.tensorboard = 1: expected bool, got int"
    assert error(["model.mlp_only_layers=3"]) == "model.mlp_only_layers = 3: expected list, got int"
    c = Config()
    c.train.seq_len = "128"  # built in Python: validate catches it too
    with pytest.raises(ConfigError, match=r"^train.seq_len = '128': expected int, got str$"):
        validate(c)


def test_bad_choice():
    assert error(["train.schedule=linear"]) == "train.schedule = 'linear': expected one of 'wsd', 'cosine', 'constant'"
    assert error(["run.device=tpu"]) == "run.device = 'tpu': expected one of 'auto', 'cpu', 'cuda'"
    assert error(["train.lb_level=batch"]) == "train.lb_level = 'batch': expected one of 'micro', 'global', 'sequence'"
    assert error(["train.dtype=float16"]) == "train.dtype = 'float16': expected one of 'auto', 'bfloat16', 'float32', 'float64'"


@pytest.mark.parametrize("key", ["parallel.pp", "parallel.ep", "train.steps", "train.global_batch",
                                 "train.micro_batch", "train.seq_len", "train.lr", "ckpt.keep", "log.every",
                                 "model.hidden_size", "model.num_hidden_layers", "model.head_dim",
                                 "model.rms_norm_eps"])
def test_non_positive_size(key):
    assert error([f"{key}=0"]) == f"{key} = 0{'.0' if key in ('train.lr', 'model.rms_norm_eps') else ''}: must be > 0"


def test_negative_and_out_of_range():
    assert error(["train.warmup=-1"]) == "train.warmup = -1: must be >= 0"
    c = Config()
    c.model.num_experts = -8
    with pytest.raises(ConfigError, match=r"^model.num_experts = -8: must be >= 0$"):
        validate(c)
    assert error(["train.beta2=1.0"]) == "train.beta2 = 1.0: must be in [0, 1)"
    assert error(["train.decay_frac=1.5"]) == "train.decay_frac = 1.5: must be in [0, 1]"
    assert validate(from_dict({}, ["train.decay_frac=1", "train.warmup=0", "train.grad_clip=0", "ckpt.every=0", "log.sample_tokens=0"]))


def test_world_size():
    assert error(["parallel.dp=2"], world_size=4) == ("parallel: pp × dp_replicate × dp × cp × ep = 1 × 1 × 2 × 1 × 1 = 2, "
                                                     "but the world size is 4; choose sizes whose product is 4")
    assert validate(from_dict({}, ["parallel.dp=2", "parallel.ep=2", "train.global_batch=16"]), 4)
    assert validate(from_dict({}, ["parallel.dp=2"]), None)  # world size unknown: not checked
    hsdp = validate(from_dict({}, ["parallel.dp=2", "parallel.dp_replicate=2", "train.global_batch=16"]), 4)
    assert (hsdp.world_size, hsdp.data_ranks, hsdp.num_micro_batches) == (4, 4, 1)


def test_experts_divisible_by_ep():
    assert error(["parallel.ep=3"], world_size=3) == \
        "parallel.ep = 3: the model's 8 routed experts are not divisible by it; use one of [1, 2, 4, 8]"


def test_global_batch_divisible():
    assert error(["train.global_batch=10"]) == \
        "train.global_batch = 10: not divisible by train.micro_batch × parallel.dp_replicate × dp × ep = 4 × 1 × 1 × 1 = 4; use a multiple of 4"
    assert error(["parallel.dp=2", "train.global_batch=12"], world_size=2).endswith("= 4 × 1 × 2 × 1 = 8; use a multiple of 8")


def test_dualpipev_needs_two_micro_batches_per_stage():
    assert error(["parallel.pp=2", "train.global_batch=8"], world_size=2) == (
        "train.global_batch = 8: gives 2 micro-batches per step (global_batch / (micro_batch × dp_replicate × dp × ep)), but DualPipeV "
        "with parallel.pp = 2 needs at least 2·pp = 4; use global_batch >= 16 or a smaller micro_batch")
    assert validate(from_dict({}, ["parallel.pp=2", "train.global_batch=16"]), 2).num_micro_batches == 4


def test_overlap_needs_two_micro_batches():
    assert error(["parallel.overlap=true", "train.global_batch=4"]) == (
        "train.global_batch = 4: gives 1 micro-batches per step (global_batch / (micro_batch × dp_replicate × dp × ep)), but DualPipeV "
        "with parallel.overlap = true needs at least 2·pp = 2; use global_batch >= 8 or a smaller micro_batch")
    assert validate(from_dict({}, ["train.global_batch=4"]), 1)  # without overlap one micro-batch is fine


def test_cp_needs_whole_chunks_and_global_balance():
    assert error(["parallel.cp=3", "train.seq_len=32"], world_size=3) == (
        "train.seq_len = 32: context parallelism cuts each sequence into 2·cp = 6 equal chunks; use a multiple of 6 "
        "(e.g. 30) or another parallel.cp")
    assert error(["parallel.cp=2", "train.lb_level=sequence"], world_size=2).startswith(
        "parallel.cp = 2 with train.lb_level = 'sequence'")
    assert validate(from_dict({}, ["parallel.cp=2"]), 2).parallel.cp == 2
    assert validate(from_dict({}, ["train.seq_len=127"]), 1)   # any length without context parallelism


def test_cp_is_refused_for_linear_attention():
    "Qwen3.5-MoE's message names the family's reason, whatever context parallelism can do for the others."
    msg = error(["model.model_type=qwen3_5_moe", "parallel.cp=2"], world_size=2)
    assert msg.startswith("parallel.cp = 2: model.model_type = 'qwen3_5_moe' has linear-attention layers")
    assert msg.endswith("set parallel.cp = 1 (use dp or ep for more GPUs)")


def test_seq_len_within_positions():
    assert error(["train.seq_len=5000"]) == (
        "train.seq_len = 5000: longer than model.max_position_embeddings = 4096; use seq_len <= 4096 (or raise "
        "max_position_embeddings where the model's RoPE scaling supports it)")


def test_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert error(["run.device=cuda"]) == "run.device = 'cuda', but torch sees no CUDA GPU here; set run.device = cpu (or auto)"


def test_bounds_declared_on_fields():
    "Every field's declared range is checked, whatever its section: a model family's own fields too."
    assert error(["model.hidden_size=0"]) == "model.hidden_size = 0: must be > 0"
    assert error(["train.beta1=1.0"]) == "train.beta1 = 1.0: must be in [0, 1)"
    assert error(["ckpt.every=-2"]) == "ckpt.every = -2: must be >= -1"
    assert validate(from_dict({}, ["model.num_experts=0"]), 1)      # 0 routed experts: a dense model


def test_top_k_at_most_experts():
    # from a file or --set, Qwen3's own __post_init__ rejects it while the section is built
    assert error(["model.num_experts_per_tok=9"]) == "[model] num_experts_per_tok=9 must be between 1 and num_experts=8"
    c = Config()
    c.model.num_experts_per_tok = 9  # changed after construction: validate's own check
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert str(e.value) == "model.num_experts_per_tok = 9: more than the model's 8 routed experts; use at most 8"
    assert validate(from_dict({}, ["model.num_experts=0"]))  # 0 experts: a dense model, top-k unused


def test_heads_divisible_by_kv_heads():
    assert error(["model.num_key_value_heads=3"]) == \
        "[model] num_key_value_heads=3 must divide num_attention_heads=4; change one of them"
    c = Config()
    c.model.num_attention_heads = 5
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert str(e.value) == ("model.num_attention_heads = 5: not divisible by model.num_key_value_heads = 2; "
                            "use a multiple of 2")


def test_byte_vocab():
    assert error(["model.vocab_size=258", "data.tokenizer=bytes"]) == (
        "model.vocab_size = 258: the byte tokenizer needs at least 259 ids (256 bytes + 3 special tokens); "
        "use vocab_size >= 259 or set data.tokenizer to a tokenizer.json")
    assert validate(from_dict({}, ["model.vocab_size=259", "data.tokenizer=bytes"]))
    assert validate(from_dict({}, ["model.vocab_size=100", "data.tokenizer=tok/tokenizer.json"]))


def test_byte_vocab_matches_the_byte_tokenizer():
    from pith_lit.train.data import ByteTokenizer
    assert BYTE_VOCAB == ByteTokenizer.vocab_size


def test_model_section_of_another_class():
    c = Config()
    c.model.model_type = "llama"
    with pytest.raises(ConfigError, match="unknown model family"):
        validate(c)


def test_missing_file_names_path(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "nope.toml")
    assert str(e.value).startswith(f"config file '{tmp_path / 'nope.toml'}' not found"), str(e.value)


def test_invalid_toml_names_path(tmp_path):
    (tmp_path / "bad.toml").write_text("[train]\nlr = \n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "bad.toml")
    assert str(e.value).startswith(f"{tmp_path / 'bad.toml'}: not valid TOML"), str(e.value)


def test_section_must_be_a_table():
    assert error([], data={"train": 3}) == "train = 3: expected a table [train] of fields"


def test_malformed_override():
    for item in ["train.lr", "lr=1", "a.b.c=1", ".lr=1", "train.=1"]:
        assert error([item]) == f"--set {item!r}: expected section.field=value, e.g. --set train.lr=1e-3"


# ---- overrides ---------------------------------------------------------------------------------------------

def test_override_parsing():
    c = from_dict({"train": {"lr": 1, "steps": 5}}, [
        "train.lr=2e-4", "train.warmup = 7", "train.compile=true", "model.mlp_only_layers=[0, 3]",
        "run.dir=out/2024", "data.tokenizer=tok/tokenizer.json", "data.corpus=123", 'run.seed=4',
        "train.beta1=1", "run.device=cpu"])
    assert c.train.lr == 2e-4 and c.train.warmup == 7 and c.train.compile is True and c.train.steps == 5
    assert c.model.mlp_only_layers == [0, 3]
    assert c.run.dir == "out/2024" and c.data.tokenizer == "tok/tokenizer.json" and c.run.seed == 4
    assert c.data.corpus == "123"  # a str field takes the text even when it reads as a number
    assert c.train.beta1 == 1.0 and type(c.train.beta1) is float  # int widened to float
    assert c.run.device == "cpu"
    assert from_dict({}, ['run.dir="quoted dir"']).run.dir == "quoted dir"
    assert from_dict({}, ["run.dir=a", "run.dir=b"]).run.dir == "b"  # the later --set wins
    assert from_dict({"train": {"lr": 1}}).train.lr == 1.0 and type(from_dict({"train": {"lr": 1}}).train.lr) is float
    assert from_dict({}) == Config()


def test_overrides_on_top_of_file(tmp_path):
    (tmp_path / "c.toml").write_text("[train]\nsteps = 50\nlr = 1e-3\n")
    c = load_config(tmp_path / "c.toml", ["train.steps=60"], world_size=1)
    assert (c.train.steps, c.train.lr, c.train.warmup) == (60, 1e-3, 30)  # override ← file ← default


def test_derived_values():
    c = from_dict({}, ["parallel.dp=2", "parallel.pp=2", "train.global_batch=32", "train.micro_batch=2"])
    assert (c.world_size, c.num_micro_batches, c.tokens_per_step) == (4, 8, 32 * 128)
    cpu = from_dict({}, ["run.device=cpu"])
    assert (cpu.device_type, cpu.torch_dtype) == ("cpu", torch.float32)
    assert from_dict({}, ["run.device=cpu", "train.dtype=bfloat16"]).torch_dtype == torch.bfloat16
    assert from_dict({}, ["run.device=cuda"]).torch_dtype == torch.bfloat16
    assert Config().device_type == ("cuda" if torch.cuda.is_available() else "cpu")


# ---- writing and reading back ------------------------------------------------------------------------------

def test_round_trip(tmp_path):
    c = from_dict({}, ["run.dir=runs/a \"quoted\" \\ dir é", "train.lr=0.1", "train.eps=1e-300",
                       "model.mlp_only_layers=[1, 2]", "model.rope_theta=1e6", "train.compile=true",
                       "parallel.dp=2", "train.global_batch=32"])
    c.run.dir += "\t\x01"  # control characters too
    (tmp_path / "used.toml").write_text(dump_toml(c))
    back = load_config(tmp_path / "used.toml", world_size=2)
    assert back == c and to_dict(back) == to_dict(c)
    assert type(back.train.lr) is float and back.train.eps == 1e-300


def test_dump_toml_non_finite_and_unsupported():
    c = Config()
    c.train.grad_clip = math.inf
    assert "grad_clip = inf" in dump_toml(c)
    c.model.mlp_only_layers = [None]
    with pytest.raises(TypeError, match="cannot write"):
        dump_toml(c)


# ---- the files in configs/ ---------------------------------------------------------------------------------

def test_configs_present():
    assert {p.name for p in CONFIGS} >= {"tiny.toml", "qwen3-30b-a3b.toml", "bench-qwen3-30b-a3b.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_file_loads_and_validates(path):
    c = load_config(path)
    assert validate(c, c.world_size) == c
    assert load_config(path, world_size=c.world_size) == c


def test_tiny_is_the_defaults():
    assert load_config(ROOT / "configs/tiny.toml", world_size=1) == Config()


def test_real_and_bench_shapes():
    real = load_config(ROOT / "configs/qwen3-30b-a3b.toml", world_size=8)
    bench = load_config(ROOT / "configs/bench-qwen3-30b-a3b.toml", world_size=1)
    m = real.model
    assert (m.vocab_size, m.hidden_size, m.num_hidden_layers, m.num_experts, m.num_experts_per_tok) == \
        (151936, 2048, 48, 128, 8)
    assert (m.moe_intermediate_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads,
            m.head_dim, m.rope_theta, m.rms_norm_eps, m.max_position_embeddings, m.norm_topk_prob) == \
        (768, 6144, 32, 4, 128, 1e6, 1e-6, 40960, True)
    assert real.data.tokenizer != "bytes"
    assert bench.model == qwen3_moe.Config(**{**to_dict(real)["model"], "num_hidden_layers": 12})
    t = bench.train
    assert (t.seq_len, t.micro_batch, t.global_batch, t.steps, t.lb_coef, t.dtype) == \
        (4096, 2, 8, 30, 0.01, "bfloat16")
    assert (bench.log.every, bench.ckpt.every, bench.log.sample_tokens) == (5, -1, 0)
    assert (bench.data.corpus, bench.data.tokenizer) == ("stdlib", "bytes")


# ---- the command line --------------------------------------------------------------------------------------

def test_parse_args(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    c = parse_args([str(ROOT / "configs/tiny.toml"), "--set", "parallel.dp=2", "--set", "train.global_batch=32"])
    assert (c.parallel.dp, c.num_micro_batches) == (2, 4)
    monkeypatch.delenv("WORLD_SIZE")
    assert parse_args([]) == Config()


def test_parse_args_error_exits_with_message(capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        parse_args(["--set", "train.schedule=linear"])
    assert e.value.code == 2
    assert "error: train.schedule = 'linear': expected one of 'wsd', 'cosine', 'constant'" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")  # the real model's config asks for 8 processes
    with pytest.raises(SystemExit) as e:
        parse_args([str(ROOT / "configs/qwen3-30b-a3b.toml")])
    assert e.value.code == 2 and "= 8, but the world size is 1;" in capsys.readouterr().err


def cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "pith_lit.train.config", *args], cwd=ROOT,
                          env=subprocess_env(**env), capture_output=True, text=True, timeout=120)


def test_cli_help_lists_every_field():
    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr
    c = Config()
    for s in fields(Config):
        for f in fields(getattr(c, s.name)):
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(f"  {s.name}.{f.name} ")), None)
            assert line is not None, f"{s.name}.{f.name} missing from --help:\n{proc.stdout}"
            assert "default" in line and f.metadata["help"] in line, line
    assert '(wsd|cosine|constant, default "wsd")' in proc.stdout


def test_cli_prints_resolved_config():
    proc = cli("configs/qwen3-30b-a3b.toml", "--set", "train.steps=700", WORLD_SIZE=8)
    assert proc.returncode == 0, proc.stderr
    assert "num_hidden_layers = 48" in proc.stdout and "ep = 4" in proc.stdout and "steps = 700" in proc.stdout


def test_warmup_longer_than_run():
    "A short smoke run with the default warmup: the message gives the --set to copy."
    assert error(["train.steps=10", "train.warmup=20", "train.schedule=constant"]) == (
        "train.warmup = 20: longer than the 10 steps before the decay (train.steps = 10); add --set train.warmup=1 "
        "(or any value up to 10)")
    assert error(["train.steps=5"]) == (
        "train.warmup = 30: longer than the 4 steps before the decay (train.steps = 5, the wsd decay the last 1); "
        "add --set train.warmup=0 (or any value up to 4)")


def test_warmup_overlaps_wsd_decay():
    msg = error(["train.steps=100", "train.warmup=90", "train.decay_frac=0.2"])
    assert msg.startswith("train.warmup = 90: longer than the 80 steps before the decay") and "up to 80" in msg
    assert load_config(overrides=["train.steps=100", "train.warmup=90", "train.schedule=cosine"]).train.warmup == 90


def test_profile_step_outside_the_run():
    assert error(["train.steps=10", "log.profile_step=11"]) == (
        "log.profile_step = 11: not a step of this run; use 1..10 (train.steps), or 0 for no trace")
    assert error(["log.profile_step=-1"]) == "log.profile_step = -1: must be >= 0"


def test_pipeline_needs_two_layers_per_rank():
    assert error(["parallel.pp=2", "model.num_hidden_layers=3", "train.global_batch=16"], 2) == (
        "parallel.pp = 2: DualPipeV cuts the model into 2·pp = 4 stages of at least one layer, but "
        "model.num_hidden_layers = 3; use parallel.pp <= 1")


def test_pipeline_stage_sizes():
    base = ["parallel.pp=2", "model.num_hidden_layers=12", "train.global_batch=16"]
    assert validate(from_dict({}, base + ["parallel.pp_stage_layers=[3, 4, 3, 2]"]), 2).parallel.pp_stage_layers == [
        3, 4, 3, 2]
    validate(from_dict({}, base + ["parallel.pp_stage_layers=[0, 6, 6, 0]"]), 2)      # the edges may be empty
    need = ("parallel.pp_stage_layers = {}: give 2·pp = 4 layer counts, one per stage, that add up to "
            "model.num_hidden_layers = 12; the edge stages (0 and 3) may have 0, every other stage needs 1 or more")
    for bad in ["[3, 4, 5]", "[3, 4, 3, 3]", "[6, 0, 3, 3]", "[3, 4, -1, 6]"]:
        assert error(base + [f"parallel.pp_stage_layers={bad}"], 2) == need.format(bad)
