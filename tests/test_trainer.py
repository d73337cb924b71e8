"""The trainer end to end on CPU: exact resume, a clean stop on SIGTERM, refusal of another model's checkpoint,
expert and pipeline parallelism (several gloo processes) against one process."""
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, subprocess_env
from pith_lit.train import checkpoint
from pith_lit.train.config import ConfigError, load_config, to_dict
from pith_lit.train.trainer import build_model, train

QUIET = ["log.sample_tokens=0", "log.tensorboard=false"]


def test_resume_repeats_straight_run_deepseek(tmp_path):
    over = ["train.steps=12", "train.warmup=2", "train.global_batch=8", "train.seq_len=64", *QUIET]
    cfg = ROOT / "configs" / "tiny-deepseek-v2.toml"
    straight = train(load_config(cfg, over + [f"run.dir={tmp_path}/a"]), quiet=True)["history"]
    split_cfg = load_config(cfg, over + [f"run.dir={tmp_path}/b"])
    split = train(split_cfg, until=5, quiet=True)["history"] + train(split_cfg, quiet=True)["history"]
    assert [r["loss"] for r in split] == [r["loss"] for r in straight]
    assert [r["step"] for r in split] == list(range(1, 13))


def test_sigterm_saves_and_resumes(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "pith_lit.train", "--set", f"run.dir={run}", "--set", "train.steps=500",
           "--set", "ckpt.every=0", *[a for q in QUIET for a in ("--set", q)]]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    done = len(metrics.read_text().splitlines())
    assert 3 <= done < 500
    last = checkpoint.latest(run)
    assert last is not None and last.name == f"step_{done:08d}"
    assert "stopped by signal" in out
    resumed = train(load_config(overrides=[f"run.dir={run}", "train.steps=500", *QUIET]), until=done + 2, quiet=True)
    assert resumed["start"] == done and [r["step"] for r in resumed["history"]] == [done + 1, done + 2]


def test_other_model_in_run_dir_is_refused(tmp_path):
    over = [f"run.dir={tmp_path}", "train.steps=2", "train.warmup=1", *QUIET]
    train(load_config(overrides=over), quiet=True)
    with pytest.raises(ValueError, match="does not match this run") as e:
        train(load_config(overrides=over + ["train.steps=4", "model.hidden_size=64"]), quiet=True)
    assert "hidden_size" in str(e.value)


def test_metrics_and_tensorboard(tmp_path):
    out = train(load_config(overrides=[f"run.dir={tmp_path}", "train.steps=3", "train.warmup=1",
                                       "log.sample_tokens=8", "log.profile_step=2"]), quiet=True)
    trace = json.loads((tmp_path / "trace-rank0.json").read_text())   # step 2 was recorded: its ranges are there
    assert any(ev.get("name") == "aten::mm" for ev in trace["traceEvents"]), "the trace holds no matmul"
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert {"step", "loss", "lb_loss", "lr", "grad_norm", "tokens_per_s", "balance", "alloc_retries"} <= r.keys()
        assert r["alloc_retries"] == 0 and r["lb_loss"] > 0      # the deferred load-balance terms were settled
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "config.toml").exists() and isinstance(out["sample"], str)


OVERLAPPED = ["parallel.ep_sync_free=true", "parallel.overlap=true"]


@pytest.mark.parametrize("variant", [[], OVERLAPPED, ["parallel.overlap=true"]],
                         ids=["plain", "sync_free_overlapped", "counted_overlapped"])
def test_expert_parallel_matches_single_process(tmp_path, variant):
    """ep 2 under torchrun (2 gloo processes, each with half the experts and half of every batch) against one
    process with all experts and the whole batch: the same loss curve; plain, and under the overlapped schedule
    with the sync-free and the counted dispatcher. The load-balance term
    is off: its running global statistic depends on the order in which micro-batches are seen, which differs
    between the two runs. float64: in float32 the two layouts' different summation orders change the gradient norm
    by up to 5e-4 relative within six steps, more than a real error would need to hide."""
    over = ["train.steps=6", "train.warmup=1", "train.lb_coef=0", "ckpt.every=-1", "train.dtype=float64", *QUIET]
    single = train(load_config(overrides=over + [f"run.dir={tmp_path}/one"]), quiet=True)["history"]
    ep_over = over + [f"run.dir={tmp_path}/ep2", "parallel.ep=2", *variant]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "pith_lit.train", *[a for o in ep_over for a in ("--set", o)]]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ep2 = [json.loads(line) for line in (tmp_path / "ep2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ep2] == [r["step"] for r in single] == list(range(1, 7))
    for a, b in zip(ep2, single):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def torchrun_train(nproc: int, overrides: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    "`python -m pith_lit.train` on `nproc` gloo processes with `--set` overrides."
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "pith_lit.train", *[a for o in overrides for a in ("--set", o)]]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_pipeline_matches_single_process(tmp_path):
    """pp 2 under torchrun (DualPipeV: each process holds two of the four one-layer stages, both read the whole batch)
    against one process running the layers one after the other: the same loss curve, gradient norm (summed over the
    pipeline ranks) and load-balance statistics. The load-balance loss is on (lb_coef 0.01, global counts): each
    layer sees the micro-batches in the same order, so it is the same loss by construction. Both runs start from a
    weights-only checkpoint of another seed, which the pipeline ranks read each for their own layers."""
    over = ["train.steps=6", "train.warmup=1", "ckpt.every=-1", "log.tensorboard=false", "log.sample_tokens=4"]
    cfg = load_config(overrides=over)
    torch.manual_seed(1)
    start = build_model(cfg.model)
    for run in ("one", "pp2"):
        checkpoint.save_weights(tmp_path / run, model=start, model_config=to_dict(cfg)["model"])
    single = train(load_config(overrides=over + [f"run.dir={tmp_path}/one"]), quiet=True)["history"]
    proc = torchrun_train(2, over + [f"run.dir={tmp_path}/pp2", "parallel.pp=2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "DualPipeV over 2 pipeline rank(s)" in proc.stdout and "no sample: greedy_sample needs the whole model" \
        in proc.stdout
    pp2 = metrics(tmp_path / "pp2")
    assert [r["step"] for r in pp2] == [r["step"] for r in single] == list(range(1, 7))
    fresh = train(load_config(overrides=over + [f"run.dir={tmp_path}/fresh", "train.steps=1", "train.warmup=0"]),
                  quiet=True)["history"][0]["loss"]
    assert abs(single[0]["loss"] - fresh) > 1e-4, "the runs should start from the saved weights, not the seed's"
    for a, b in zip(pp2, single):
        for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4), ("lb_loss", 1e-5), ("balance", 1e-5)):
            assert a[key] == pytest.approx(b[key], rel=rel), (a["step"], key, a[key], b[key])


def test_overlap_matches_plain_and_resumes(tmp_path):
    """parallel.overlap at pp 1 (DualPipeV with one pipeline rank, forwards beside backwards) against the plain loop:
    the same losses; and a run split in two repeats the straight overlapped run exactly (nothing is split among ranks,
    so checkpoints work)."""
    over = ["train.steps=4", "train.warmup=1", *QUIET]
    plain = train(load_config(overrides=over + [f"run.dir={tmp_path}/plain", "ckpt.every=-1"]), quiet=True)["history"]
    ov = over + ["parallel.overlap=true"]
    straight = train(load_config(overrides=ov + [f"run.dir={tmp_path}/a", "ckpt.every=-1"]), quiet=True)["history"]
    for a, b in zip(straight, plain):
        for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4), ("lb_loss", 1e-5), ("balance", 1e-5)):
            assert a[key] == pytest.approx(b[key], rel=rel), (a["step"], key, a[key], b[key])
    split_cfg = load_config(overrides=ov + [f"run.dir={tmp_path}/b"])
    split = train(split_cfg, until=2, quiet=True)["history"] + train(split_cfg, quiet=True)["history"]
    assert [r["loss"] for r in split] == [r["loss"] for r in straight]


def test_pipeline_refuses_a_wrong_process_count(tmp_path):
    "A process count that is not pp × dp × cp × ep is refused before anything is written."
    over = [f"run.dir={tmp_path}", "parallel.pp=2", *QUIET]
    with pytest.raises(ConfigError, match=r"= 2, but 1 process\(es\) were launched; launch 2"):
        train(load_config(overrides=over), quiet=True)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_pipeline_resume_repeats_straight_run(tmp_path):
    """pp 2: a run resumed from its step-3 checkpoint repeats the straight run's steps 4-6 exactly; with rank 0
    holding one layer (stage sizes 0, 2, 1, 1: stage 0 only embeds)."""
    over = ["train.steps=6", "train.warmup=1", "ckpt.every=3", *QUIET, "parallel.pp=2",
            "parallel.pp_stage_layers=[0, 2, 1, 1]"]
    proc = torchrun_train(2, over + [f"run.dir={tmp_path}/a"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    (tmp_path / "b" / "ckpt").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "ckpt" / "step_00000003", tmp_path / "b" / "ckpt" / "step_00000003")
    proc = torchrun_train(2, over + [f"run.dir={tmp_path}/b"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    straight, resumed = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]


# Checkpoints saved at one layout load at another. Each chain trains one step per layout, each layout resuming from
# the checkpoint the previous one saved, so every pair of neighbours is a save and a load at different layouts:
# 1 → pp 2 (each rank loads its stages' layers), pp 2 → ep 2 × dp 2 (experts split, then sharded by FSDP), ep 2 ×
# dp 2 → HSDP, HSDP → cp 2, cp 2 → pp 2 × ep 2, pp 2 × ep 2 → 1 (everything gathered onto one process), and for
# Muon's state dp 2 → ep 2. (processes, overrides) per layout:
ONE, PP2, EP2, DP2 = (1, []), (2, ["parallel.pp=2"]), (2, ["parallel.ep=2"]), (2, ["parallel.dp=2"])
EP2DP2, PP2EP2 = (4, ["parallel.ep=2", "parallel.dp=2"]), (4, ["parallel.pp=2", "parallel.ep=2"])
HSDP, CP2 = (4, ["parallel.dp_replicate=2", "parallel.dp=2"]), (2, ["parallel.cp=2"])
RESHARD = {"1-pp2-ep2dp2-hsdp-cp2-pp2ep2-1": ([ONE, PP2, EP2DP2, HSDP, CP2, PP2EP2, ONE], []),
           "muon-dp2-ep2": ([DP2, EP2], ["train.optimizer=muon"])}


@pytest.mark.parametrize("chain", RESHARD, ids=list(RESHARD))
def test_checkpoint_loads_at_another_layout(tmp_path, chain):
    """A checkpoint saved at one layout (pp, dp_replicate, dp, cp, ep, world size) loads at the next layout of the
    chain: model and optimizer states are resharded by DCP, the log says so, and every step's loss equals the
    straight run's on one process (float64, so only the order of additions differs between layouts; a constant
    learning rate, so that each run's train.steps changes nothing). The load-balance term is off: its running global
    statistic depends on the order in which the data ranks' micro-batches are seen, which differs between layouts."""
    layouts, extra = RESHARD[chain]
    over = ["train.warmup=1", "train.schedule=constant", "ckpt.every=1", "train.dtype=float64", "train.micro_batch=2",
            "train.seq_len=32", "train.lb_coef=0", *QUIET, *extra]
    straight = train(load_config(overrides=over + [f"train.steps={len(layouts)}", f"run.dir={tmp_path}/straight",
                                                   "ckpt.every=-1"]), quiet=True)["history"]
    for step, (nproc, sizes) in enumerate(layouts, start=1):
        proc = torchrun_train(nproc, over + sizes + [f"train.steps={step}", f"run.dir={tmp_path}/chain"])
        assert proc.returncode == 0, f"step {step} at {sizes}: {proc.stderr[-4000:]}"
        if step > 1:
            assert f"resumed from step {step - 1}" in proc.stdout, proc.stdout
            assert "resharded from" in proc.stdout, (sizes, proc.stdout)
    chained = metrics(tmp_path / "chain")
    assert [r["step"] for r in chained] == list(range(1, len(layouts) + 1))
    for a, b in zip(chained, straight):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9), (a, b)


def test_muon_run_resumes_exactly(tmp_path):
    "train.optimizer = muon: the loss falls, and a run split at step 3 repeats the straight run (Muon's state resumes)."
    over = ["train.steps=6", "train.warmup=1", "train.optimizer=muon", "train.seq_len=32", *QUIET]
    straight = train(load_config(overrides=over + [f"run.dir={tmp_path}/a", "ckpt.every=-1"]), quiet=True)["history"]
    split_cfg = load_config(overrides=over + [f"run.dir={tmp_path}/b", "ckpt.every=3"])
    split = train(split_cfg, until=3, quiet=True)["history"] + train(split_cfg, quiet=True)["history"]
    assert [r["loss"] for r in split] == [r["loss"] for r in straight]
    assert straight[-1]["loss"] < straight[0]["loss"] - 0.3


def test_fp8_copies_kept_only_when_asked(tmp_path):
    """The experts' FP8 copies are made at each use unless `train.fp8_keep_copies` asks (and a step runs several
    micro-batches with the experts whole), and keeping them changes no value: the same losses both ways."""
    from pith_lit.train.trainer import fp8_copies_kept
    over = ["train.fp8=true", "train.steps=3", "train.warmup=1", "train.global_batch=4", "train.micro_batch=2",
            "train.seq_len=32", *QUIET]
    cfg = ROOT / "configs" / "tiny.toml"
    made, kept = (load_config(cfg, over + [f"run.dir={tmp_path}/{k}", f"train.fp8_keep_copies={k}"])
                  for k in ("false", "true"))
    assert not fp8_copies_kept(made) and fp8_copies_kept(kept)
    assert not fp8_copies_kept(load_config(cfg, over + ["train.fp8_keep_copies=true", "train.micro_batch=4"]))
    losses = [[r["loss"] for r in train(c, quiet=True)["history"]] for c in (made, kept)]
    assert len(losses[0]) == 3 and losses[0] == losses[1], losses
