"""Shared test setup: every subprocess gets the Triton interpreter, one CPU thread, and the repo root."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"


def subprocess_env(**extra) -> dict:
    """Environment for child processes: CPU-only Triton interpreter, one thread per process, no GPU."""
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               MPLBACKEND="Agg")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def bin_path(name: str) -> str:
    """A console script installed beside the running interpreter (the venv's nbdev_test, torchrun, ...)."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else name


@pytest.fixture
def env():
    return subprocess_env()
