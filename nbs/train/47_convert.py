# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # `python -m pith_lit.convert`
#
# Two commands join Hugging Face checkpoints (train/hf) to runs:
#
# ```bash
# python -m pith_lit.convert pith2hf runs/tiny runs/tiny-hf        # a run's latest checkpoint as a Hugging Face model
# python -m pith_lit.convert hf2pith runs/tiny-hf runs/from-hf     # a run directory that starts from such a model
# python -m pith_lit.train runs/from-hf/config.toml --set train.steps=20 --set train.warmup=2   # train it on
# ```
#
# (runs/tiny is the README Quickstart's run; any Hugging Face checkpoint directory of a supported family works in
# place of runs/tiny-hf.)
#
# **hf2pith** reads the checkpoint with `load_hf`, in the dtype its config.json names (so no bit of a bf16
# checkpoint is lost or doubled), and writes two things into a new run directory: `config.toml`, whose
# `[model]` section is the imported model's config and whose other sections are the defaults, with `run.dir`
# set to the directory (the data, the tokenizer and the schedule are the user's to set); and the weights-only
# checkpoint `ckpt/step_00000000` (train/checkpoint's `save_weights`). The trainer then finds that checkpoint
# like any other, checks it against `[model]`, loads the weights and starts at step 0 with a fresh optimizer.
#
# **pith2hf** takes a run directory (its latest checkpoint) or one checkpoint directory. The model's config
# comes from the checkpoint's meta.json, which is the config the weights were trained with (so a checkpoint
# directory copied away from its run converts too); the weights are read with `load_weights` in the dtype
# they were saved in, and written with `save_hf`.
#
# Errors about the input (a config.json we do not model, a tensor missing, a directory that already holds
# files) keep their traceback, whose last line says what to change.

# %%
#| default_exp convert

# %%
#| export
import argparse
import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from pith_lit.train import checkpoint
from pith_lit.train.config import (Config, DataConfig, ExistingFile, InvalidInput, MissingFile, RunConfig, dump_toml,
                                   from_dict, run_command, to_dict)
from pith_lit.train.hf import empty_model, load_hf, read_hf_config, save_hf

# %%
import shutil
import tempfile

from pith_lit.models.qwen3_moe import Config as QwenConfig
from pith_lit.tokenize import tokenize_files
from pith_lit.train.config import load_config
from pith_lit.train.data import build_dataset
from pith_lit.train.trainer import build_model, train

# %% [markdown]
# ## hf2pith

# %%
#| export
def _hf_dtype(hf: dict) -> torch.dtype:
    "The dtype config.json names (`torch_dtype`, or 5.x's `dtype`); float32 when it names none."
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidInput(f"config.json: dtype {name!r} is not a torch dtype; use e.g. bfloat16 or float32")
    return dtype


def hf2pith(src, dst) -> Path:
    "Make `dst` a new run directory that starts from the Hugging Face checkpoint `src`; returns `dst`."
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ExistingFile(f"{dst} already holds files; hf2pith makes a new run directory")
    model = load_hf(src, _hf_dtype(read_hf_config(src)))
    # the data default, a BPE trained here, fits no imported vocabulary: bytes until the user names the tokenizer
    cfg = Config(run=RunConfig(dir=str(dst)), model=model.config, data=DataConfig(tokenizer="bytes"))
    checkpoint.save_weights(dst, model=model, model_config=to_dict(cfg)["model"])
    (dst / "config.toml").write_text(
        f"# Written by python -m pith_lit.convert hf2pith\n#   {src} -> {dst}\n"
        "# [model] is the Hugging Face checkpoint's config.json; the other sections are the defaults: set the data\n"
        "# (for this model's vocabulary, data.tokenizer = its tokenizer.json) and the schedule before training.\n"
        "# The weights are the weights-only checkpoint ckpt/step_00000000.\n\n"
        + dump_toml(cfg))
    return dst

# %% [markdown]
# Check: a tiny Qwen3-MoE written as a Hugging Face checkpoint in bf16 (`save_hf`), imported. The run directory
# holds the config and the step-0 checkpoint, `load_config` reads the config back to the same model, and the
# trainer's `checkpoint.load` puts the same bf16 weights into a freshly built model and returns step 0.

# %%
root = Path(tempfile.mkdtemp())
qcfg = QwenConfig(vocab_size=260, hidden_size=32, moe_intermediate_size=16, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                  num_experts_per_tok=2, initializer_range=0.1)
torch.manual_seed(0)
hf_model = build_model(qcfg).bfloat16()
save_hf(hf_model, root / "hf")
hf2pith(root / "hf", root / "run")
assert sorted(p.name for p in (root / "run").iterdir()) == ["ckpt", "config.toml"]
cfg = load_config(root / "run/config.toml")
assert cfg.model == qcfg and cfg.run.dir == str(root / "run")
fresh = build_model(cfg.model)
fresh_opt = torch.optim.AdamW(fresh.parameters())
start = checkpoint.load(checkpoint.latest(root / "run"), model=fresh, optimizer=fresh_opt,
                        model_config=to_dict(cfg)["model"])
assert start == 0 and not fresh_opt.state
assert all(torch.equal(a, b.float()) for a, b in zip(fresh.state_dict().values(), hf_model.state_dict().values()))
print((root / "run/config.toml").read_text()[:400])

# %% [markdown]
# The trainer continues from it. Two steps on a small corpus: the first step's loss is the imported model's own
# loss on the first batch, computed here with the model's plain sequential forward (no engine piece).

# %%
(root / "text.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
tokenize_files([root / "text.txt"], root / "corpus")
over = [f"data.corpus={root / 'corpus'}", "train.steps=2", "train.warmup=0", "train.global_batch=2",
        "train.micro_batch=2", "train.seq_len=16", "log.tensorboard=false", "log.sample_tokens=0"]
cfg = load_config(root / "run/config.toml", over)
out = train(cfg, quiet=True)
assert out["start"] == 0 and [r["step"] for r in out["history"]] == [1, 2]

data, _ = build_dataset(cfg.data.corpus, "bytes", root / "cache", 16, cfg.run.seed, 0, 1, qcfg.vocab_size)
x, y = data.batch(0, 0, 2, 1)
with torch.no_grad():
    expected = torch.nn.functional.cross_entropy(fresh.reference_forward(x).flatten(0, 1), y.flatten()).item()
print(f"first loss {out['history'][0]['loss']:.6f}, the imported model's loss {expected:.6f}")
assert abs(out["history"][0]["loss"] - expected) < 1e-5 * expected

# %% [markdown]
# ## pith2hf
#
# The dtype the weights were saved in is in DCP's index, the tensor list every checkpoint carries.

# %%
#| export
def _saved_dtype(path: Path) -> torch.dtype:
    "The dtype of the model's weights in checkpoint `path`, from DCP's index."
    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return next(v.properties.dtype for k, v in index.items() if k.startswith("model."))


def pith2hf(src, dst) -> Path:
    "Write the model of checkpoint `src` (a run directory: its latest) as a Hugging Face checkpoint `dst`."
    src = Path(src)
    path = src if (src / "meta.json").is_file() else checkpoint.latest(src)
    if path is None:
        raise MissingFile(f"{src} is neither a checkpoint directory (it has no meta.json) nor a run "
                                f"directory with a complete checkpoint under {src / 'ckpt'}")
    model_config = json.loads((path / "meta.json").read_text())["model_config"]
    model = empty_model(from_dict({"model": model_config}).model, _saved_dtype(path))
    checkpoint.load_weights(path, model=model, model_config=model_config)
    return save_hf(model, dst)

# %% [markdown]
# Check: the run trained above, exported. Reading the export back gives the weights of its step-2 checkpoint.

# %%
pith2hf(root / "run", root / "out")
back = load_hf(root / "out")
trained = build_model(qcfg)
assert checkpoint.load_weights(checkpoint.latest(root / "run"), model=trained, model_config=to_dict(cfg)["model"]) == 2
assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), trained.state_dict().values()))
assert not all(torch.equal(a, b.float()) for a, b in zip(back.state_dict().values(), hf_model.state_dict().values()))
pith2hf(root / "run/ckpt/step_00000000", root / "out0")  # one checkpoint directory: the imported weights
assert all(torch.equal(a, b) for a, b in zip(load_hf(root / "out0", torch.bfloat16).state_dict().values(),
                                             hf_model.state_dict().values()))

# %% [markdown]
# Neither command writes into a directory that holds files, and pith2hf says what it looks for:

# %%
for call in (lambda: hf2pith(root / "hf", root / "run"), lambda: pith2hf(root / "run", root / "out"),
             lambda: pith2hf(root / "hf", root / "out2")):
    try:
        call()
        raise AssertionError("no error")
    except (FileExistsError, FileNotFoundError) as e:
        print(e)

# %% [markdown]
# ## The command line

# %%
#| export
def main(argv: list[str] | None = None) -> int:
    """Run `hf2pith` or `pith2hf` from command-line arguments (default sys.argv[1:]); returns the exit status (2 with
    one line for an input the user can fix)."""
    parser = argparse.ArgumentParser(prog="python -m pith_lit.convert",
                                     description="Convert between Hugging Face checkpoints and pith_lit runs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    a = commands.add_parser("hf2pith", help="make a run directory that starts from a Hugging Face checkpoint")
    a.add_argument("src", help="Hugging Face checkpoint directory: config.json and *.safetensors")
    a.add_argument("dst", help="the new run directory: config.toml and ckpt/step_00000000")
    b = commands.add_parser("pith2hf", help="write a pith_lit checkpoint as a Hugging Face checkpoint")
    b.add_argument("src", help="a run directory (its latest checkpoint) or a checkpoint directory")
    b.add_argument("dst", help="the new Hugging Face checkpoint directory")
    parser.add_argument("--debug", action="store_true", help="show the whole traceback of an error (also PITH_DEBUG=1)")
    args = parser.parse_args(argv)

    def run():
        match args.command:
            case "hf2pith":
                dst = hf2pith(args.src, args.dst)
                print(f"wrote {dst}; train it with: python -m pith_lit.train {dst / 'config.toml'} "
                      f"--set run.dir={dst} {_tokenizer_advice(Path(args.src))}")
            case "pith2hf":
                print(f"wrote {pith2hf(args.src, args.dst)}")
    return run_command(run, argv)


def _tokenizer_advice(src: Path) -> str:
    "The data settings to train an imported checkpoint with: its own tokenizer.json, when it ships one."
    tok = src / "tokenizer.json"
    if tok.exists():
        return f"--set data.tokenizer={tok} --set data.corpus=DATA (tokenized with it by python -m pith_lit.tokenize)"
    return ("and its tokenizer: this checkpoint ships no tokenizer.json, so data.tokenizer stays 'bytes' (right for a "
            "model trained by pith_lit on bytes); for a published model take its tokenizer.json from where the model "
            "is published, tokenize the data with it (python -m pith_lit.tokenize FILES --out DATA --tokenizer "
            "TOKENIZER_JSON) and add --set data.corpus=DATA --set data.tokenizer=TOKENIZER_JSON")


if __name__ == "__main__" and __spec__ is not None:
    raise SystemExit(main())

# %%
main(["pith2hf", str(root / "run/ckpt/step_00000002"), str(root / "out2")])
assert (root / "out2/model.safetensors").is_file()

# %%
shutil.rmtree(root)
