"""The trainer end to end on CPU: exact resume, a clean stop on SIGTERM, refusal of another model's checkpoint."""
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, subprocess_env
from pith_lit.train import checkpoint
from pith_lit.train.config import load_config
from pith_lit.train.trainer import train

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
                                       "log.sample_tokens=8"]), quiet=True)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert {"step", "loss", "lb_loss", "lr", "grad_norm", "tokens_per_s", "balance"} <= r.keys()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "config.toml").exists() and isinstance(out["sample"], str)


def test_expert_parallel_matches_single_process(tmp_path):
    """ep 2 under torchrun (2 gloo processes, each with half the experts and half of every batch) against one
    process with all experts and the whole batch: the same loss curve. The load-balance term is off: its running
    global statistic depends on the order in which micro-batches are seen, which differs between the two runs."""
    over = ["train.steps=6", "train.warmup=1", "train.lb_coef=0", "ckpt.every=-1", *QUIET]
    single = train(load_config(overrides=over + [f"run.dir={tmp_path}/one"]), quiet=True)["history"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "pith_lit.train", *[a for o in over + [f"run.dir={tmp_path}/ep2", "parallel.ep=2"] for a in ("--set", o)]]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ep2 = [json.loads(line) for line in (tmp_path / "ep2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ep2] == [r["step"] for r in single] == list(range(1, 7))
    for a, b in zip(ep2, single):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
