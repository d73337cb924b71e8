"""The planner (engine/37 and 38, python -m pith_lit.plan), the trainer's memory check, parallel.pp_stage_layers = "auto",
and the two memory skills."""
import dataclasses
import json
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env
from test_skills import skill_env
from test_trainer import QUIET, torchrun_train


def test_plan_lists_the_layouts_of_eight_gpus(capsys):
    "Qwen3-30B-A3B on 8 GPUs of 140 GiB: some layouts fit, one GPU's worth does not, and the table says so."
    from pith_lit.plan import main
    real = str(ROOT / "configs" / "qwen3-30b-a3b.toml")
    assert main([real, "--gpus", "8", "--gpu-memory", "140", "--set", "run.device=cpu"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    n, fit = int(first.split()[0]), int(first.split(",")[1].split()[0])
    assert 0 < fit < n, first
    one = ["--set", "parallel.pp=1", "--set", "parallel.ep=1", "--set", "train.global_batch=8"]
    assert main([real, "--set", "run.device=cpu", "--gpu-memory", "140", *one]) == 0
    assert "does not fit" in capsys.readouterr().out   # the whole 30B model on one GPU


def test_plan_of_a_tiny_model_names_where_its_peak_falls(capsys):
    "A peak with no part as large as 0.05 GiB still reads as a sentence: where it falls, with nothing before it."
    from pith_lit.plan import main
    assert main([str(ROOT / "configs" / "tiny.toml")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "GiB per GPU (at the loss of micro-batch 1)" in first, first


def test_plan_predicts_step_time_from_a_profile(tmp_path, capsys):
    "With a profile the table has tokens/s, and a pipelined layout gets a cut other than the even one."
    from pith_lit.engine.steptime import Profile
    from pith_lit.plan import main
    prof = Profile(4096, "made up", True, {"moe full": {"F": 5.0, "B": 8.0, "W": 3.0}}, {"F": 40.0, "B": 3.0},
                   {"F": 0.1, "B": 1.0}, {"moe full": 0.5, "moe full experts": 4.0, "root": 1.0})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(dataclasses.asdict(prof)))
    cfg = str(ROOT / "configs" / "bench-qwen3-30b-a3b.toml")
    assert main([cfg, "--set", "run.device=cpu", "--set", "train.dtype=bfloat16", "--gpus", "2", "--profile",
                 str(path), "--gpu-memory", "140", "--top", "40"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "MFU" in out
    pipelined = [line for line in out.splitlines()[2:] if line.split()[0] == "2"]
    assert pipelined and all(line.split()[-1] != "even" for line in pipelined), out
    assert main([cfg, "--profile", str(tmp_path / "missing.json")]) == 2


def test_memory_check_refuses_and_can_be_turned_off():
    from pith_lit.train.config import ConfigError, load_config
    from pith_lit.train.trainer import memory_verdict
    cfg = load_config(overrides=["run.device=cpu"])
    with pytest.raises(ConfigError, match="is predicted to fit|use more GPUs"):
        memory_verdict(cfg, 1)
    off = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, memory_check=False))
    assert memory_verdict(off, 1).peak.total > 0


def test_stage_layers_auto_on_two_pipeline_ranks(tmp_path):
    "pp 2 with pp_stage_layers = \"auto\": rank 0 measures, both ranks cut alike, and config.toml records the cut."
    proc = torchrun_train(2, ["train.steps=2", "train.warmup=0", "parallel.pp=2", "parallel.pp_stage_layers=auto",
                              f"run.dir={tmp_path}", *QUIET])
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in (tmp_path / "config.toml").read_text().splitlines() if l.startswith("pp_stage_layers"))
    cut = json.loads(line.split("=", 1)[1])
    assert len(cut) == 4 and sum(cut) == 4 and f"stages of {cut} layers" in proc.stdout, (line, proc.stdout[-2000:])


def test_stage_layers_refuses_other_words():
    from pith_lit.train.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="expected list|auto"):
        load_config(overrides=["parallel.pp_stage_layers=even"])


@pytest.mark.parametrize("skill", ["estimate-memory", "add-memory-prints"])
def test_memory_skills_pass_on_cpu(skill):
    proc = subprocess.run(["bash", f"skills/{skill}/check.sh"], cwd=ROOT, capture_output=True, text=True,
                          env=skill_env(), timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("PASS"), proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = subprocess.run(["bash", f"skills/{skill}/check.sh", "--bogus"], cwd=ROOT, capture_output=True, text=True,
                          env=skill_env(), timeout=60)
    assert proc.returncode == 1 and proc.stdout.strip().splitlines()[-2:] == ["unknown option --bogus; use [--gpu]",
                                                                              "FAIL"]
