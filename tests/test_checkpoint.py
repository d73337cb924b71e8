"""pith_lit.train.checkpoint: killed saves, refused checkpoints, bitwise-exact resume, damaged files (missing,
short, or changed at the same size: checksums), and a 2-rank FSDP2 save that loads back on 2 ranks and reshards
into one process. Bitwise resume uses a 2-layer
Qwen3-MoE; the other tests a tiny MLP with dropout.

The subprocess parts run this file as a script (`python tests/test_checkpoint.py MODE ...`, or under torchrun),
so each resume starts from a fresh process state.
"""
import dataclasses
import hashlib
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.fsdp import fully_shard

from conftest import ROOT, bin_path, subprocess_env
from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM
from pith_lit.train.checkpoint import DamagedCheckpoint, latest, load, save

HERE = str(Path(__file__).resolve())


# --- a stand-in training loop ---------------------------------------------------------------------------
class LossEMA:
    "A Stateful extra that is not a torch object: an exponential moving average of the loss."
    def __init__(self):
        self.value = 0.0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


def make(hidden=16, seed=0, mesh=None):
    "Model, AdamW, extras (a scheduler, a Stateful, a plain counter) and the model config; FSDP2 over `mesh`."
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(hidden, 1))
    if mesh is not None:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    return model, opt, {"sched": sched, "ema": LossEMA(), "tokens": 0}, {"model_type": "mlp_test", "hidden": hidden}


def train(model, opt, extra, start, stop, rank=0):
    """Steps start..stop-1. Data: a torch.Generator seeded by (step, rank). Randomness from the global
    generators: dropout (torch), a label shift (numpy) and a loss scale (random)."""
    losses = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 + 10 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        y = y + float(np.random.randn()) * 0.1
        loss = torch.nn.functional.mse_loss(model(x), y) * (1 + 0.1 * random.random())
        loss.backward()
        opt.step()
        extra["sched"].step()
        opt.zero_grad()
        extra["ema"].value = 0.9 * extra["ema"].value + 0.1 * loss.item()
        extra["tokens"] += x.shape[0]
        losses.append(loss.item())
    return losses


def seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def run_script(*args, timeout=120):
    proc = subprocess.run([sys.executable, HERE, *map(str, args)], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


# --- (a) a save killed midway ---------------------------------------------------------------------------
def kill_target(run_dir):
    "Save step 2, then start saving step 4 and stop after DCP has written its files, for the test to SIGKILL."
    import torch.distributed.checkpoint as dcp
    seed_all(0)
    model, opt, extra, cfg = make()
    train(model, opt, extra, 0, 2)
    save(run_dir, 2, model=model, optimizer=opt, extra=extra, model_config=cfg)
    train(model, opt, extra, 2, 4)
    real_save = dcp.save

    def save_then_hang(*args, **kwargs):
        real_save(*args, **kwargs)
        print("PAUSED", flush=True)
        time.sleep(120)
    dcp.save = save_then_hang  # the DCP files are written; RNG files, meta.json and the rename are not
    save(run_dir, 4, model=model, optimizer=opt, extra=extra, model_config=cfg)
    raise SystemExit("the save was not killed")


def test_killed_save(tmp_path):
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, HERE, "kill", str(tmp_path)], cwd=ROOT, env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=err, text=True)
        deadline, line = time.monotonic() + 120, ""
        while "PAUSED" not in line and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                if not line:  # the child exited before pausing
                    break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert "PAUSED" in line, (tmp_path / "stderr.txt").read_text()[-3000:]

    ckpt = tmp_path / "ckpt"
    assert sorted(os.listdir(ckpt)) == [".tmp_step_00000004", "step_00000002"]
    written = sorted(os.listdir(ckpt / ".tmp_step_00000004"))
    assert ".metadata" in written and "meta.json" not in written, written  # killed midway
    assert latest(tmp_path) == ckpt / "step_00000002"

    seed_all(0)
    model, opt, extra, cfg = make(seed=3)
    assert load(latest(tmp_path), model=model, optimizer=opt, extra=extra, model_config=cfg) == 2
    assert extra["tokens"] == 32 and extra["sched"].last_epoch == 2
    train(model, opt, extra, 2, 4)
    save(tmp_path, 4, model=model, optimizer=opt, extra=extra, model_config=cfg)
    assert sorted(os.listdir(ckpt)) == ["step_00000002", "step_00000004"]  # the leftover is gone
    assert latest(tmp_path) == ckpt / "step_00000004"


# --- (b) another model is refused -----------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    "A run directory with a checkpoint of step 3 of the hidden=16 model."
    seed_all(0)
    model, opt, extra, cfg = make()
    train(model, opt, extra, 0, 3)
    save(tmp_path, 3, model=model, optimizer=opt, extra=extra, model_config=cfg)
    return tmp_path


def refused(path, hidden, model_config, extra_keys=("sched", "ema", "tokens")) -> str:
    "Load into a trained hidden-wide model, expect ValueError, check nothing was changed; return the message."
    model, opt, extra, _ = make(hidden=hidden, seed=5)
    train(model, opt, extra, 0, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    before_opt = [s["exp_avg"].clone() for s in opt.state.values()]
    with pytest.raises(ValueError) as e:
        load(path, model=model, optimizer=opt, extra={k: extra[k] for k in extra_keys}, model_config=model_config)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(before_opt, opt.state.values()))
    return str(e.value)


def test_refuses_other_model(saved):
    path = latest(saved)
    msg = refused(path, 32, {"model_type": "mlp_test", "hidden": 32})
    assert f"checkpoint {path} does not match this run" in msg
    assert "config hidden: checkpoint 16, this run 32" in msg
    assert "parameter 0.weight: checkpoint shape [16, 8], this run [32, 8]" in msg
    assert "Resume with the config the checkpoint was written with, or set another run.dir" in msg

    msg = refused(path, 16, {"model_type": "other_moe", "hidden": 16})
    assert "model_type: checkpoint 'mlp_test', this run 'other_moe'" in msg

    msg = refused(path, 16, {"model_type": "mlp_test", "hidden": 16, "num_experts": 8})
    assert "config num_experts: checkpoint '(absent)', this run 8" in msg

    # the same config but another shape (a code change): the parameter is named
    msg = refused(path, 24, {"model_type": "mlp_test", "hidden": 16})
    assert "config hidden" not in msg and "parameter 3.weight: checkpoint shape [1, 16], this run [1, 24]" in msg

    msg = refused(path, 16, {"model_type": "mlp_test", "hidden": 16}, extra_keys=("sched", "tokens"))
    assert "extra 'ema': in the checkpoint, not passed to load" in msg


# --- (c) resuming is bitwise exact ----------------------------------------------------------------------
def make_qwen(seed=0, **overrides):
    "A 2-layer Qwen3-MoE with the same optimizer and extras as `make`, and its config as a dict."
    config = Config(num_hidden_layers=2, **overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    return model, opt, {"sched": sched, "ema": LossEMA(), "tokens": 0}, dataclasses.asdict(config)


def train_qwen(model, opt, extra, start, stop):
    """Next-token loss on random ids from a generator seeded by the step. Randomness from the global
    generators: dropout on the logits (torch), a loss offset (numpy) and a loss scale (random)."""
    losses = []
    for step in range(start, stop):
        ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1000 + step))
        logits = torch.nn.functional.dropout(model(ids[:, :-1])[0], 0.1)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss = loss * (1 + 0.1 * random.random()) + 0.01 * float(np.random.randn())
        loss.backward()
        opt.step()
        extra["sched"].step()
        opt.zero_grad()
        extra["ema"].value = 0.9 * extra["ema"].value + 0.1 * loss.item()
        extra["tokens"] += ids[:, :-1].numel()
        losses.append(loss.item())
    return losses


def resume_target(mode, run_dir):
    """straight: 20 steps. first: 10 steps and a save. resume: fresh state, load, 10 steps. Writes losses. One CPU
    thread in every mode: the resume runs in a subprocess, and a matmul split over another number of threads may
    round differently."""
    run_dir = Path(run_dir)
    torch.set_num_threads(1)
    if mode == "resume":
        seed_all(123)  # nothing of the first process's RNG state may survive except through the checkpoint
        model, opt, extra, cfg = make_qwen(seed=77)
        start = load(latest(run_dir), model=model, optimizer=opt, extra=extra, model_config=cfg)
    else:
        seed_all(0)
        model, opt, extra, cfg = make_qwen()
        start = 0
    stop = 10 if mode == "first" else 20
    losses = train_qwen(model, opt, extra, start, stop)
    if mode == "first":
        save(run_dir, stop, model=model, optimizer=opt, extra=extra, model_config=cfg)
    (run_dir / f"{mode}.json").write_text(json.dumps({
        "losses": [x.hex() for x in losses], "ema": extra["ema"].value.hex(), "tokens": extra["tokens"],
        "lr": opt.param_groups[0]["lr"]}))
    torch.save(model.state_dict(), run_dir / f"{mode}.pt")


def test_resume_is_exact(tmp_path):
    threads = torch.get_num_threads()
    try:
        resume_target("straight", tmp_path)
        resume_target("first", tmp_path)
    finally:
        torch.set_num_threads(threads)
    run_script("resume", "resume", tmp_path)  # a fresh process: only the checkpoint carries state over
    straight, first, resumed = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("straight", "first", "resume"))
    assert len(first["losses"]) == 10 and len(straight["losses"]) == 20
    assert first["losses"] + resumed["losses"] == straight["losses"]  # bitwise, at every step
    assert (resumed["ema"], resumed["tokens"], resumed["lr"]) == (straight["ema"], straight["tokens"], straight["lr"])
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resume.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)

    # the same checkpoint refuses a Qwen3-MoE with fewer experts, naming the config field and the tensors
    model, opt, extra, cfg = make_qwen(num_experts=4)
    with pytest.raises(ValueError) as e:
        load(latest(tmp_path), model=model, optimizer=opt, extra=extra, model_config=cfg)
    assert "config num_experts: checkpoint 8, this run 4" in str(e.value)
    assert "parameter model.layers.0.mlp.gate.weight: checkpoint shape [8, 128], this run [4, 128]" in str(e.value)


# --- (d) damaged checkpoints ----------------------------------------------------------------------------
def load_fresh(path):
    model, opt, extra, cfg = make(seed=9)
    return load(path, model=model, optimizer=opt, extra=extra, model_config=cfg)


@pytest.mark.parametrize("damage", ["shard removed", "shard truncated", "rng removed", "index removed",
                                    "meta removed"])
def test_damaged_checkpoint(saved, damage):
    path = latest(saved)
    shard, rng = path / "__0_0.distcp", path / "rng_rank00000.pt"
    match damage:
        case "shard removed":
            shard.unlink()
            with pytest.raises(FileNotFoundError, match=re.escape(f"checkpoint {path} is damaged: {shard} is missing")):
                load_fresh(path)
        case "shard truncated":
            os.truncate(shard, shard.stat().st_size // 2)
            with pytest.raises(ValueError, match=re.escape(f"checkpoint {path} is damaged: {shard} has ") + r"\d+ bytes"):
                load_fresh(path)
        case "rng removed":
            rng.unlink()
            with pytest.raises(FileNotFoundError, match=re.escape(f"checkpoint {path} is damaged: {rng} is missing")):
                load_fresh(path)
        case "index removed":
            (path / ".metadata").unlink()
            with pytest.raises(FileNotFoundError, match=re.escape(f"{path / '.metadata'} is missing")):
                load_fresh(path)
        case "meta removed":
            (path / "meta.json").unlink()
            with pytest.raises(FileNotFoundError, match=re.escape(f"{path} is not a complete checkpoint: it has no meta.json")):
                load_fresh(path)
            assert latest(saved) is None


# --- (e) damage of the same size: checksums -------------------------------------------------------------
def flip(f: Path):
    "Flip one bit in the middle of file `f`; its size stays the same."
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 1]))


@pytest.fixture
def two_saved(tmp_path):
    "A run directory with checkpoints of steps 2 and 4."
    seed_all(0)
    model, opt, extra, cfg = make()
    for step in (2, 4):
        train(model, opt, extra, step - 2, step)
        save(tmp_path, step, model=model, optimizer=opt, extra=extra, model_config=cfg)
    return tmp_path


def test_same_size_damage_falls_back(two_saved, capsys):
    ckpt = two_saved / "ckpt"
    step2, step4 = ckpt / "step_00000002", ckpt / "step_00000004"
    shard = step4 / "__0_0.distcp"
    size = shard.stat().st_size
    assert json.loads((step4 / "meta.json").read_text())["files"]["__0_0.distcp"]["size"] == size
    flip(shard)
    damaged = shard.read_bytes()
    assert len(damaged) == size
    with pytest.raises(DamagedCheckpoint, match=re.escape(
            f"checkpoint {step4} is damaged: {shard} does not match its sha256 checksum (saved: {size} bytes, sha256 ")):
        load_fresh(step4)

    assert latest(two_saved) == step2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"checkpoint {step4} is damaged: {shard} does not match its "
                                                    f"sha256 checksum (saved: {size} bytes")
    assert out.endswith(f"; kept as {ckpt / 'damaged_step_00000004'} for inspection; falling back to the previous "
                        f"good one {step2}\n")
    assert (ckpt / "damaged_step_00000004/__0_0.distcp").read_bytes() == damaged  # kept as it was

    # the run resumes from step 2 and saves step 4 again; the damaged copy stays
    model, opt, extra, cfg = make(seed=3)
    assert load(latest(two_saved), model=model, optimizer=opt, extra=extra, model_config=cfg) == 2
    train(model, opt, extra, 2, 4)
    save(two_saved, 4, model=model, optimizer=opt, extra=extra, model_config=cfg)
    assert sorted(os.listdir(ckpt)) == ["damaged_step_00000004", "step_00000002", "step_00000004"]
    assert latest(two_saved) == step4 and capsys.readouterr().out == ""


def test_only_checkpoint_damaged(saved, capsys):
    path = latest(saved)
    rng = path / "rng_rank00000.pt"
    flip(rng)
    before = sorted(os.listdir(saved / "ckpt")), sorted(os.listdir(path))
    with pytest.raises(DamagedCheckpoint) as e:
        latest(saved)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {path} is damaged: {rng} does not match its sha256 checksum")
    assert msg.endswith(f"there is no earlier good checkpoint to fall back to. Nothing was changed: move it out of "
                        f"{saved / 'ckpt'} to start this run again from step 0, or set run.dir to a new directory")
    assert (sorted(os.listdir(saved / "ckpt")), sorted(os.listdir(path))) == before and capsys.readouterr().out == ""


@pytest.mark.parametrize("damage", ["cut short", "not utf-8", "field missing", "edited"])
def test_corrupt_meta_json(two_saved, damage, capsys):
    ckpt = two_saved / "ckpt"
    step2, step4 = ckpt / "step_00000002", ckpt / "step_00000004"
    meta_file = step4 / "meta.json"
    text = meta_file.read_text()
    meta = json.loads(text)
    match damage:
        case "cut short":
            meta_file.write_text(text[:len(text) // 2])
            reason = "its meta.json is not valid JSON ("
        case "not utf-8":
            meta_file.write_bytes(b"\xff" + text.encode()[1:])
            reason = "its meta.json is not valid JSON ("
        case "field missing":
            del meta["world_size"]
            meta_file.write_text(json.dumps(meta))
            reason = "its meta.json lacks world_size or holds a wrong value there"
        case "edited":  # valid JSON, plausible, wrong: only meta.json's own checksum sees it
            meta_file.write_text(json.dumps({**meta, "step": 5}))
            reason = "its meta.json does not match its own checksum"
    bad = meta_file.read_bytes()
    with pytest.raises(DamagedCheckpoint) as e:
        load_fresh(step4)
    assert str(e.value).startswith(f"checkpoint {step4} is damaged: {reason}") and "\n" not in str(e.value)
    assert latest(two_saved) == step2
    out = capsys.readouterr().out
    assert out.startswith(f"checkpoint {step4} is damaged: {reason}") and out.count("\n") == 1
    assert sorted(os.listdir(ckpt)) == ["damaged_step_00000004", "step_00000002"]
    assert (ckpt / "damaged_step_00000004/meta.json").read_bytes() == bad  # kept as it was


def test_saved_before_checksums(saved, capsys):
    "A meta.json without `files` and `meta_sha256` (the format before checksums) loads, checked by size only."
    path = latest(saved)
    meta = json.loads((path / "meta.json").read_text())
    assert set(meta["files"]) == {".metadata", "__0_0.distcp", "rng_rank00000.pt"} and "meta_sha256" in meta
    (path / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("files", "meta_sha256")}))
    assert latest(saved) == path and load_fresh(path) == 3 and capsys.readouterr().out == ""
    shard = path / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)  # the size check from DCP's index still applies
    with pytest.raises(DamagedCheckpoint, match=re.escape(f"checkpoint {path} is damaged: {shard} has ")):
        load_fresh(path)


def test_bad_save_arguments(tmp_path):
    model, opt, extra, cfg = make()
    with pytest.raises(ValueError, match="before the optimizer's first step"):
        save(tmp_path, 0, model=model, optimizer=opt, extra=extra, model_config=cfg)
    train(model, opt, extra, 0, 1)
    with pytest.raises(ValueError, match="model_config has no 'model_type'"):
        save(tmp_path, 1, model=model, optimizer=opt, extra=extra, model_config={"hidden": 16})
    with pytest.raises(ValueError, match=r"extra keys \['a.b', 'model'\] are not allowed"):
        save(tmp_path, 1, model=model, optimizer=opt, extra={"model": 1, "a.b": 2}, model_config=cfg)
    save(tmp_path, 1, model=model, optimizer=opt, extra=extra, model_config=cfg)
    with pytest.raises(FileExistsError, match="step_00000001 already exists and is never overwritten"):
        save(tmp_path, 1, model=model, optimizer=opt, extra=extra, model_config=cfg)


# --- FSDP2 on 2 gloo ranks: save, load back, reshard into one process -----------------------------------
def dist_target(run_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    run_dir = Path(run_dir)
    dist.init_process_group("gloo")
    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,))
    model, opt, extra, cfg = make(seed=0, mesh=mesh)
    seed_all(100 + rank)  # each rank its own dropout masks and noise
    train(model, opt, extra, 0, 2, rank)
    path = save(run_dir, 2, model=model, optimizer=opt, extra=extra, model_config=cfg)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    after = train(model, opt, extra, 2, 4, rank)
    path4 = save(run_dir, 4, model=model, optimizer=opt, extra=extra, model_config=cfg)
    if rank == 0:  # both ranks' files are recorded with their checksums; then one bit of rank 1's shard flips
        files = json.loads((path4 / "meta.json").read_text())["files"]
        assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank00000.pt", "rng_rank00001.pt"]
        assert all(e["size"] == (path4 / n).stat().st_size and
                   e["sha256"] == hashlib.sha256((path4 / n).read_bytes()).hexdigest() for n, e in files.items())
        flip(path4 / "__1_0.distcp")
    dist.barrier()

    seed_all(7)
    model, opt, extra, cfg = make(seed=5, mesh=mesh)
    last = latest(run_dir)  # the ranks share the hashing and agree on the verdict
    assert last == path, f"rank {rank}: latest() gave {last}"
    assert load(last, model=model, optimizer=opt, extra=extra, model_config=cfg) == 2
    assert train(model, opt, extra, 2, 4, rank) == after, f"rank {rank}: resumed losses differ"
    if rank == 0:
        assert sorted(p.name for p in path.iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "rng_rank00000.pt", "rng_rank00001.pt"]
        torch.save({"full": full, "after": after}, run_dir / "expected.pt")
    dist.barrier()   # everything is written; the process ends in __main__ without tearing gloo down (see there)


def test_fsdp2_two_ranks_and_reshard(tmp_path):
    proc = subprocess.run([bin_path("torchrun"), "--standalone", "--nproc-per-node", "2", HERE, "dist", str(tmp_path)],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    ckpt = tmp_path / "ckpt"
    assert proc.stdout.count(" is damaged: ") == 1, proc.stdout  # said once, by rank 0
    assert (f"checkpoint {ckpt / 'step_00000004'} is damaged: {ckpt / 'step_00000004/__1_0.distcp'} does not match "
            "its sha256 checksum") in proc.stdout
    assert sorted(os.listdir(ckpt)) == ["damaged_step_00000004", "step_00000002"]
    expected = torch.load(tmp_path / "expected.pt")
    # one plain process reads the 2-rank sharded checkpoint and takes rank 0's RNG states (0 mod 2)
    model, opt, extra, cfg = make(seed=5)
    assert load(latest(tmp_path), model=model, optimizer=opt, extra=extra, model_config=cfg) == 2
    assert all(torch.equal(expected["full"][k], v) for k, v in model.state_dict().items())
    assert extra["sched"].last_epoch == 2 and extra["tokens"] == 32
    # its first step sees rank 0's weights, data and dropout mask, so rank 0's loss; the next one differs,
    # because the 2-rank run averaged the gradients of two batches
    losses = train(model, opt, extra, 2, 4, rank=0)
    assert losses[0] == expected["after"][0] and losses[1] != expected["after"][1]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    match sys.argv[1]:
        case "kill":
            kill_target(sys.argv[2])
        case "resume":
            resume_target(sys.argv[2], sys.argv[3])
        case "dist":
            dist_target(sys.argv[2])
            # gloo's teardown (destroy_process_group, or the interpreter's exit) has aborted a worker with
            # "terminate called without an active exception" on a loaded 2-core machine after every check had
            # passed; end the process here instead, as run_ranked does after a failure
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        case other:
            raise SystemExit(f"unknown mode {other!r}: kill, resume or dist")


@pytest.fixture
def one_rank_group():
    "A gloo group of one process for FSDP2 in this process; closed again after the test."
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fp32_masters_computing_in_bf16_round_trip(tmp_path, one_rank_group):
    """FSDP2's mixed precision on a one-rank mesh: fp32 parameters (the masters) computing in bf16; the optimizer
    state is fp32 and named by the parameters, and a resume continues bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from pith_lit.train.optim import build_optimizer

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)),
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        return model, build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)

    def step(model, opt, i):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    cfg = {"model_type": "toy"}
    model, opt = make()
    straight = [step(model, opt, i) for i in range(6)]
    model, opt = make()
    first = [step(model, opt, i) for i in range(3)]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.dim() > 0)
    save(tmp_path, 3, model=model, optimizer=opt, model_config=cfg)
    model, opt = make()
    assert load(latest(tmp_path), model=model, optimizer=opt, model_config=cfg) == 3
    assert first + [step(model, opt, i) for i in range(3, 6)] == straight
