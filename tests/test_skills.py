"""The skills' verification scripts, where they run on a CPU in seconds."""
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, subprocess_env


def skill_env() -> dict:
    "The scripts call `python`: make it this interpreter (CI runs the venv's python without activating it)."
    return subprocess_env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def test_profile_step_skill_passes_on_cpu():
    proc = subprocess.run(["bash", "skills/profile-step/check.sh"], cwd=ROOT, capture_output=True, text=True,
                          env=skill_env(), timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("PASS"), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the step's matmuls are in the trace" in proc.stdout


def test_profile_step_skill_refuses_a_missing_gpu_or_option():
    proc = subprocess.run(["bash", "skills/profile-step/check.sh", "--bogus"], cwd=ROOT, capture_output=True,
                          text=True, env=skill_env(), timeout=60)
    assert proc.returncode == 1 and proc.stdout.strip().splitlines()[-2:] == [
        "unknown option --bogus; use [--gpu] [--gpus N]", "FAIL"]
