"""Expert parallelism and the device mesh beyond their notebooks: the EP self-check on 2 and 4 gloo processes
against a single-process run (all routing cases, float32 and float64), the dispatcher's byte counters against a
count made from the router outputs alone, failing fast when one rank raises, the configured collective timeout
on mesh groups, a SLURM-style launch without torchrun, and the error messages."""
import json
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from conftest import ROOT, subprocess_env
from pith_lit.engine.ep import EPDispatcher
from pith_lit.testing import qwen3_routing
from pith_lit.engine.mesh import build_mesh, first_host, launch_env

TOKENS = 256   # tokens per rank for the traffic measurement


def run_worker(nproc: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "-m", "pith_lit.testing", "ep", "--tokens", str(TOKENS)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def router_count(world: int, ep: int, row_bytes: int = 2048 * 2) -> tuple[int, int]:
    "Bytes all ranks send to other ranks, deduplicated and not, from the router outputs (rank g is g % ep in ep)."
    dedup = undedup = 0
    for g in range(world):
        dest = qwen3_routing(g, TOKENS)[1].ids // (128 // ep)
        home = g % ep
        other = dest != home
        undedup += int(other.sum())
        sends = torch.zeros(dest.shape[0], ep, dtype=torch.bool).scatter_(1, dest, True)
        dedup += int(sends.sum()) - int(sends[:, home].sum())
    return dedup * row_bytes, undedup * row_bytes


def check_result(res: dict, world: int, meshes: set):
    cases = {(c["dp"], c["ep"], c["case"], c["dtype"], c["dispatcher"]) for c in res["checks"]}
    assert cases == {(dp, ep, *case) for dp, ep in meshes for case in [
        ("random", "float32", "counted"), ("random", "float64", "counted"), ("wide", "float32", "counted"),
        ("wide", "float64", "counted"), ("one_expert", "float64", "counted"), ("one_rank", "float32", "counted"),
        ("random", "float64", "sync_free"), ("wide", "float32", "sync_free"), ("one_rank", "float64", "sync_free")]}
    for c in res["checks"]:
        assert c["max_rel_err"] <= (1e-5 if c["dtype"] == "float32" else 1e-12), c
        if c["case"] == "wide":
            assert c["top_k"] > 8 // c["ep"]                     # more experts per token than per rank
        if c["case"] == "one_rank" and c["dispatcher"] == "counted":
            assert c["traffic"]["dispatch"] == 0                 # rank 0 keeps everything; the others get nothing
        if c["dispatcher"] == "sync_free":                       # whole blocks of T rows go to every other rank
            assert c["traffic"]["dispatch"] > 0
    for ep in (2, 4):
        if world % ep == 0:
            t = res["traffic"][str(ep)]
            assert (t["dispatch"], t["dispatch_undeduplicated"]) == router_count(world, ep), (ep, t)
            assert t["calls"] == world
            assert t["combine"] == t["dispatch"]                   # summed: one row back per row sent
            assert t["dispatch"] < t["dispatch_undeduplicated"]


def test_ep_two_processes():
    check_result(run_worker(2), 2, {(1, 2)})


def test_ep_four_processes():
    check_result(run_worker(4), 4, {(1, 4), (2, 2)})       # ep = 4, and dp = 2 × ep = 2


FAIL = """
import sys, time
import torch, torch.distributed as dist
from pith_lit.engine.mesh import build_mesh, init_distributed, run_ranked

def main(mode):
    rank, world, _ = init_distributed(120 if mode == "raise" else 2, "cpu")
    mesh = build_mesh(1, 1, 1, world, "cpu", 120 if mode == "raise" else 2)
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.ep)           # everyone is up and connected
    print(f"rank {rank} of {world} ready, sum {t.item():.0f}", flush=True)
    if mode == "raise":
        if rank == 1:
            raise ValueError("boom on rank 1")
        while True:                              # a rank that would never notice (e.g. stuck in NCCL)
            time.sleep(1)
    if rank == 1:                                # mode "timeout": rank 1 skips the collective for a while
        time.sleep(5)
        return
    dist.all_reduce(t, group=mesh.ep)

run_ranked(main, sys.argv[1])
"""


def test_fail_fast(tmp_path):
    "Rank 1 raises while rank 0 would wait forever: the job ends within seconds with rank 1's traceback."
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), "raise"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "rank 0 of 2 ready" in proc.stdout and "rank 1 of 2 ready" in proc.stdout
    assert "[rank 1] ValueError: boom on rank 1" in proc.stderr, proc.stderr[-3000:]
    assert '[rank 1]   File "' in proc.stderr                   # the whole traceback, prefixed
    assert elapsed < 40, f"took {elapsed:.0f} s"


def test_slurm_launch_and_collective_timeout(tmp_path):
    """Two tasks started as srun would (SLURM_* variables, no torchrun) rendezvous at the node list's first host;
    then rank 0 waits in an all-reduce that rank 1 skips, and the 2 s timeout of the mesh groups ends it."""
    script = tmp_path / "timeout.py"
    script.write_text(FAIL)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in subprocess_env().items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    procs = [subprocess.Popen([sys.executable, str(script), "timeout"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(base, SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r),
                                       SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="1", MASTER_PORT=str(port)))
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert "rank 0 of 2 ready" in outs[0][0] and "rank 1 of 2 ready" in outs[1][0], outs
    assert procs[1].returncode == 0, outs[1][1][-3000:]
    assert procs[0].returncode == 1, outs[0][1][-3000:]
    assert "[rank 0] RuntimeError" in outs[0][1] and "Timed out" in outs[0][1], outs[0][1][-3000:]


def test_launch_env():
    assert first_host("gpu-a[12-15,20]-ib,gpu-b1") == "gpu-a12-ib"
    env = dict(SLURM_PROCID="9", SLURM_NTASKS="16", SLURM_LOCALID="1", SLURM_NODELIST="n[4-5]", SLURM_JOB_ID="41",
               MASTER_ADDR="10.1.1.1")
    assert launch_env(env) == dict(rank=9, world=16, local_rank=1, master_addr="10.1.1.1", master_port=20041)


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_errors(fake_world):
    with pytest.raises(ValueError, match=r"pp × dp_replicate × dp × cp × ep = 1 × 1 × 2 × 1 × 1 = 2, but 4 processes were launched"):
        build_mesh(1, 2, 1, 1, "cpu", 60)
    mesh = build_mesh(1, 1, 1, 4, "cpu", 60)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the expert-parallel size 4"):
        EPDispatcher(mesh.ep, 6)
    from pith_lit.engine.ep import all_to_all
    with pytest.raises(ValueError, match="send must sum to the 3 rows of x"):
        all_to_all(torch.zeros(3, 2), [1, 1, 1, 1], [1, 1, 1, 1], mesh.ep)
