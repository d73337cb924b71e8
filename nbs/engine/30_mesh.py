# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The device mesh
#
# A run on many GPUs divides its processes four ways at once: pipeline stages (pp), data-parallel replicas
# (dp), context-parallel pieces of each sequence (cp) and expert-parallel shares of the routed experts (ep).
# Every collective in the engine runs over one of those axes, or over a product of them. This notebook builds
# the process groups once, from torch's own `DeviceMesh`, and hands them out by name; it also starts the
# process group from the launcher's environment (torchrun or SLURM) and makes a failure on one rank end the
# whole job at once, with that rank's traceback, instead of leaving the other ranks waiting in a collective.
#
# | piece | what |
# |---|---|
# | `launch_env()` | rank, world size, local rank and rendezvous address from torchrun's or SLURM's variables |
# | `init_distributed(timeout_s, device_type)` | the default process group (NCCL on CUDA, gloo on CPU) |
# | `build_mesh(pp, dp, cp, ep, device_type, timeout_s)` | a `Mesh`: a group per axis, and three products |
# | `stage_layers(num_layers, pp, sizes)` | the layers each of the 2·pp pipeline stages holds |
# | `run_ranked(fn)` | run `fn`; on an exception print it with the rank and end the process at once |

# %%
#| default_exp engine.mesh

# %%
#| export
import math
import os
import re
import sys
import traceback
from dataclasses import dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# %% [markdown]
# ## Who am I: torchrun or SLURM
#
# torchrun sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` in every process it
# starts. A job launched by SLURM's `srun` without torchrun has none of them, but every task knows
# `SLURM_PROCID` (its global rank), `SLURM_NTASKS` (the number of tasks) and `SLURM_LOCALID` (its rank on its
# node). The rendezvous address is the first host of the job's node list (`SLURM_JOB_NODELIST`, in SLURM's
# compressed form such as `gpu[003-006,010]`), and the port is derived from the job id so that two jobs
# sharing a node do not collide; an explicit `MASTER_ADDR` / `MASTER_PORT` in the environment wins. When
# both are present torchrun's variables win: `srun torchrun ...` starts one torchrun per node, and its
# workers are the ranks. With neither, the process is a single rank.
#
# One caveat: the batch script's own shell also carries SLURM variables; start the training processes with
# `srun` (or torchrun), never directly from the batch script.

# %%
#| export
def first_host(nodelist: str) -> str:
    "The first host of a SLURM node list, as `scontrol show hostnames` lists it: `gpu[003-006,010],cpu1` -> `gpu003`."
    head = re.match(r"[^,\[]*", nodelist).group()
    rest = nodelist[len(head):]
    if not rest.startswith("["):
        return head
    ranges, rest = rest[1:].split("]", 1)
    return head + ranges.split(",")[0].split("-")[0] + first_host(rest)


def launch_env(env=os.environ) -> dict:
    """rank, world, local_rank, master_addr, master_port from torchrun's variables, else SLURM's, else a single
    process (addresses None)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return dict(rank=int(env["RANK"]), world=int(env["WORLD_SIZE"]), local_rank=int(env.get("LOCAL_RANK", 0)),
                    master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]))
    if "SLURM_PROCID" in env:
        nodes = env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
        return dict(rank=int(env["SLURM_PROCID"]), world=int(env["SLURM_NTASKS"]),
                    local_rank=int(env["SLURM_LOCALID"]), master_addr=env.get("MASTER_ADDR") or first_host(nodes),
                    master_port=int(env.get("MASTER_PORT") or 20000 + int(env["SLURM_JOB_ID"]) % 20000))
    return dict(rank=0, world=1, local_rank=0, master_addr=None, master_port=None)

# %%
assert first_host("gpu[003-006,010],cpu1") == "gpu003"
assert first_host("node7,node8") == "node7"
assert first_host("rack[2-3]-n[07,09]") == "rack2-n07"
assert first_host("solo") == "solo"

torchrun = dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500",
                SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_NODELIST="x[1-2]", SLURM_JOB_ID="7")
assert launch_env(torchrun) == dict(rank=3, world=8, local_rank=1, master_addr="10.0.0.1", master_port=29500)
slurm = {k: v for k, v in torchrun.items() if k.startswith("SLURM")} | dict(SLURM_PROCID="5", SLURM_NTASKS="16",
                                                                          SLURM_LOCALID="1", SLURM_JOB_ID="123456")
assert launch_env(slurm) == dict(rank=5, world=16, local_rank=1, master_addr="x1", master_port=20000 + 123456 % 20000)
assert launch_env({}) == dict(rank=0, world=1, local_rank=0, master_addr=None, master_port=None)

# %% [markdown]
# ## The default process group
#
# NCCL on CUDA, gloo on CPU. On CUDA each process takes the GPU of its local rank, and passing `device_id`
# initialises NCCL at once, which lets the mesh below split its groups from the default one (`ncclCommSplit`)
# instead of creating each from scratch. `timeout_s` (config `parallel.timeout_s`) bounds how long a collective
# may wait for a missing rank before it raises. A single process also gets a (one-rank) group, from an
# in-memory store, so that the same code builds a mesh at any size.

# %%
#| export
def init_distributed(timeout_s: float, device_type: str) -> tuple[int, int, torch.device]:
    "Start the default process group from `launch_env()`; returns (rank, world, device)."
    e = launch_env()
    match device_type:
        case "cuda":
            device, backend = torch.device("cuda", e["local_rank"]), "nccl"
            torch.cuda.set_device(device)
        case "cpu":
            device, backend = torch.device("cpu"), "gloo"
        case other:
            raise ValueError(f"device_type={other!r}: use 'cuda' or 'cpu'")
    if dist.is_initialized():
        raise RuntimeError("init_distributed: the default process group is already initialised; call it once")
    timeout, device_id = timedelta(seconds=timeout_s), (device if backend == "nccl" else None)
    if e["master_addr"] is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device_id)
    else:
        os.environ.setdefault("MASTER_ADDR", e["master_addr"])
        os.environ.setdefault("MASTER_PORT", str(e["master_port"]))
        dist.init_process_group(backend, init_method="env://", rank=e["rank"], world_size=e["world"],
                                timeout=timeout, device_id=device_id)
    return e["rank"], e["world"], device

# %% [markdown]
# ## The mesh
#
# The processes form a grid of shape (pp, dp_replicate, dp, cp, ep), **ep innermost**: the ranks of one
# expert-parallel group are consecutive, so on a node of 8 GPUs an ep group of up to 8 stays inside the node, on
# NVLink, where the all-to-alls of every MoE layer are cheap. Rank r sits at grid position
# `r = (((p·R + q)·dp + d)·cp + c)·ep + e` with R = dp_replicate.
#
# Data parallelism has two axes. `dp` ranks **shard** the parameters, gradients and optimizer states among
# themselves (FSDP2, engine/36); `dp_replicate` groups of them hold the same shards (HSDP: replicate across
# groups, shard within), which keeps the all-gathers inside a group when the groups are nodes. Besides one group
# per axis the trainer needs three products, each for a reason:
#
# - `batch` = dp_replicate × dp × ep: the ranks that read **different data**. An expert-parallel rank runs the
#   whole non-expert model on its own tokens (only the experts are divided), so ep ranks are data-parallel for
#   everything but the experts. Data is sharded over `batch.rank()` of `batch.size()`. (cp ranks share a batch
#   and split each sequence.)
# - `dense` = dp_replicate × dp × cp × ep: the ranks that hold the **same non-expert weights** and saw different
#   tokens. Gradients of non-expert parameters are summed over it, and so are token counts, the loss, and the
#   load-balance statistics.
# - `expert` = dp_replicate × dp × cp: the ranks that hold the **same experts**. Expert gradients are summed over
#   it only: the tokens of the other ep ranks already reached this rank's experts through the all-to-all, so
#   their contribution is in the local gradient.
#
# FSDP2 takes device meshes rather than groups: `dense_mesh` shards non-expert parameters over dp × cp × ep
# (with a leading dp_replicate dimension for HSDP), `expert_mesh` shards experts over dp × cp (the same), and
# `ep_mesh` is the axis along which the experts themselves are divided.
#
# The products come from `DeviceMesh._flatten`, which is what TorchTitan uses (a private name, but the one way to
# get a group over several mesh dimensions that DeviceMesh knows about). Groups made by `DeviceMesh` do not
# inherit the default group's timeout, so each gets the configured one explicitly through its backend options.
# %%
#| export
@dataclass
class Mesh:
    "The process groups of one rank (one per mesh axis and the products batch, dense, expert) and FSDP's meshes."
    device_mesh: DeviceMesh
    pp: dist.ProcessGroup
    replicate: dist.ProcessGroup    # dp_replicate: HSDP groups that hold the same shards
    dp: dist.ProcessGroup           # the ranks that shard parameters among themselves
    cp: dist.ProcessGroup
    ep: dist.ProcessGroup
    batch: dist.ProcessGroup    # dp_replicate × dp × ep: ranks that read different data
    dense: dist.ProcessGroup    # dp_replicate × dp × cp × ep: same non-expert weights; sum their gradients here
    expert: dist.ProcessGroup   # dp_replicate × dp × cp: same experts; sum expert gradients here
    dense_mesh: DeviceMesh = None   # FSDP: non-expert parameters, sharded over dp × cp × ep
    expert_mesh: DeviceMesh = None  # FSDP: experts, sharded over dp × cp
    ep_mesh: DeviceMesh = None      # the experts' own division

    def ranks(self) -> dict[str, list[int]]:
        "Global ranks of each group this rank belongs to (for logs and checks)."
        return {f.name: dist.get_process_group_ranks(getattr(self, f.name)) for f in fields(self)[1:]
                if isinstance(getattr(self, f.name), dist.ProcessGroup)}


def _backend_options(timeout: timedelta):
    "(backend, options carrying `timeout`) for the groups DeviceMesh creates; None keeps the backend's defaults."
    match dist.get_backend():
        case "nccl":
            opts = dist.ProcessGroupNCCL.Options()
        case "gloo":
            opts = dist.ProcessGroupGloo._Options()
        case _:
            return None       # e.g. the "fake" backend of torch's tests: no timeouts to set
    opts._timeout = timeout   # DeviceMesh reads this private field when it creates a group
    return dist.get_backend(), opts


def build_mesh(pp: int, dp: int, cp: int, ep: int, device_type: str, timeout_s: float,
               dp_replicate: int = 1) -> Mesh:
    "The (pp, dp_replicate, dp, cp, ep) mesh over all processes of the default group; every rank must call it."
    world, sizes = dist.get_world_size(), (pp, dp_replicate, dp, cp, ep)
    if min(sizes) < 1 or math.prod(sizes) != world:
        raise ValueError(f"parallel.pp × dp_replicate × dp × cp × ep = {' × '.join(map(str, sizes))} = "
                         f"{math.prod(sizes)}, but {world} processes were launched; make the product equal the "
                         "number of processes (or launch that many)")
    timeout, names = timedelta(seconds=timeout_s), ("pp", "dp_replicate", "dp", "cp", "ep")
    opts = _backend_options(timeout)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names,
                            backend_override=None if opts is None else {n: opts for n in names})

    def flat(*dims):
        return mesh[dims]._flatten("_".join(dims), backend_override=_backend_options(timeout))

    groups = [mesh.get_group(n) for n in names]
    products = [flat(*d).get_group() for d in (("dp_replicate", "dp", "ep"), ("dp_replicate", "dp", "cp", "ep"),
                                                ("dp_replicate", "dp", "cp"))]
    shard_dense, shard_expert = flat("dp", "cp", "ep"), flat("dp", "cp")
    if dp_replicate > 1:    # HSDP: (replicate, shard) meshes
        shard_dense, shard_expert = mesh["dp_replicate", "dp_cp_ep"], mesh["dp_replicate", "dp_cp"]
    return Mesh(mesh, *groups, *products, shard_dense, shard_expert, mesh["ep"])

# %% [markdown]
# ### Check: the groups of every rank
#
# torch's test backend `fake` lets one process play any rank of any world size without talking to anyone, so
# we can build the mesh as each of the 32 ranks of a grid with every axis 2 in turn and compare its groups with
# the grid position formula above, worked out independently: the ranks of a group are those that agree with
# this rank on every coordinate outside the group's axes.

# %%
from torch.testing._internal.distributed.fake_pg import FakeStore

sizes = dict(pp=2, dp_replicate=2, dp=2, cp=2, ep=2)
grid = torch.arange(32).view(*sizes.values())            # grid[p, q, d, c, e] = global rank
axes = dict(pp=("pp",), replicate=("dp_replicate",), dp=("dp",), cp=("cp",), ep=("ep",),
            batch=("dp_replicate", "dp", "ep"), dense=("dp_replicate", "dp", "cp", "ep"),
            expert=("dp_replicate", "dp", "cp"))

def expected(rank, group_axes):
    coord = [int(i) for i in (grid == rank).nonzero()[0]]
    keep = [n not in group_axes for n in sizes]
    return sorted(int(r) for r in grid.flatten()
                  if all(c == int(x) for c, x, k in zip(coord, (grid == r).nonzero()[0], keep) if k))

for rank in range(32):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=32)
    mesh = build_mesh(**sizes, device_type="cpu", timeout_s=60)
    got = mesh.ranks()
    fsdp = {"dense_mesh": mesh.dense_mesh.mesh.flatten().tolist(), "expert_mesh": mesh.expert_mesh.mesh.flatten().tolist()}
    dist.destroy_process_group()
    assert got == {name: expected(rank, a) for name, a in axes.items()}, (rank, got)
    assert fsdp == {"dense_mesh": got["dense"], "expert_mesh": got["expert"]}, (rank, fsdp)
got   # the groups of rank 31

# %% [markdown]
# Rank 31, at grid position (1, 1, 1, 1, 1), shares its experts' work with rank 30, reads different data from
# the ranks of its batch group (pipeline stage 1, cp coordinate 1), sums non-expert gradients over the 16 ranks
# of stage 1 and expert gradients over the 8 of them that hold the same experts (ep coordinate 1). FSDP's meshes
# span exactly the `dense` and `expert` groups.
#
# A size mismatch fails before any group is made:

# %%
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
try:
    build_mesh(1, 2, 1, 4, "cpu", 60)
    raise AssertionError("expected a ValueError")
except ValueError as err:
    assert "= 8, but 4 processes" in str(err), err
    print(err)
finally:
    dist.destroy_process_group()

# %% [markdown]
# ## Which layers each pipeline stage holds
#
# With pp pipeline ranks the model is cut into 2·pp **stages** of consecutive layers, and DualPipeV
# (engine/33) puts stages r and 2·pp−1−r on rank r. `stage_layers` says which layers each stage holds. It lives
# here, with the rest of the job's layout, so that the config can check a requested split without importing the
# pipeline executor.
#
# When the layers do not divide evenly, the extra layers go to the stages farthest from the ends of the model:
# the edge stages (0 and 2·pp−1, both on rank 0) also run the embedding and the head with the loss, so they get
# fewer layers; stage 0 (the cheap embedding) is served before stage 2·pp−1 (the head, a large matmul).
# `sizes` (`parallel.pp_stage_layers`) gives the layers of every stage instead. The edge stages may then be
# empty: stage 0 runs only the embedding, the last stage only the head and the loss. Rank 0's head and loss
# can cost several layers (about three for the Qwen3 bench config at vocabulary 151,936); benchmarks/RESULTS.md
# ("Pipeline stage sizes") has the splits that measured fastest.

# %%
#| export
def stage_layers(num_layers: int, pp_size: int, sizes: list[int] | None = None) -> list[list[int]]:
    """The layer indices of each of the 2·pp_size stages, in order; the middle stages get the extra layers first.
    `sizes`: the number of layers of each stage, given (the edge stages may have none)."""
    n = 2 * pp_size
    if sizes:
        counts = all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in sizes)
        if len(sizes) != n or not counts or sum(sizes) != num_layers or min(sizes[1:-1], default=1) < 1:
            raise ValueError(f"parallel.pp_stage_layers = {sizes}: give 2·pp = {n} layer counts, one per stage, "
                             f"that add up to model.num_hidden_layers = {num_layers}; the edge stages (0 and {n - 1}) "
                             "may have 0, every other stage needs 1 or more")
    else:
        if num_layers < n:
            raise ValueError(f"parallel.pp = {pp_size}: DualPipeV cuts the model into 2·pp = {n} stages of at least "
                             f"one layer, but model.num_hidden_layers = {num_layers}; use parallel.pp <= "
                             f"{num_layers // 2}")
        sizes = [num_layers // n] * n
        for s in sorted(range(n), key=lambda s: (-min(s, n - 1 - s), s))[:num_layers % n]:
            sizes[s] += 1
    starts = [sum(sizes[:s]) for s in range(n)]
    return [list(range(a, a + k)) for a, k in zip(starts, sizes)]

# %%
assert stage_layers(4, 2) == [[0], [1], [2], [3]]
assert stage_layers(6, 2) == [[0], [1, 2], [3, 4], [5]]
assert stage_layers(7, 2) == [[0, 1], [2, 3], [4, 5], [6]]
assert stage_layers(5, 1) == [[0, 1, 2], [3, 4]]
for L, P in [(48, 4), (27, 4), (61, 8)]:
    s = stage_layers(L, P)
    assert sum(s, []) == list(range(L)) and max(map(len, s)) - min(map(len, s)) <= 1
assert [len(x) for x in stage_layers(12, 2, sizes=[3, 4, 3, 2])] == [3, 4, 3, 2]
assert stage_layers(5, 2, sizes=[0, 3, 2, 0]) == [[], [0, 1, 2], [3, 4], []]
for bad in [[3, 4, 3], [3, 4, 3, 3], [3, 0, 5, 4], [3, 4, 3.0, 2]]:     # too few, too many layers, an empty middle
    try:
        stage_layers(12, 2, sizes=bad)
        raise AssertionError(bad)
    except ValueError as e:
        assert "parallel.pp_stage_layers" in str(e)
try:
    stage_layers(3, 2)
    raise AssertionError("expected a ValueError")
except ValueError as e:
    print(e)
print("48 layers on 4 ranks:", [len(x) for x in stage_layers(48, 4)],
      "· 27 layers:", [len(x) for x in stage_layers(27, 4)])

# %% [markdown]
# ## Failing fast
#
# When one rank raises, the others are usually inside a collective waiting for it, and will wait until the
# collective timeout (10 minutes by default); an exception that unwinds normally can also hang in the process
# group's shutdown. `run_ranked(fn)` catches the exception, prints its traceback with every line prefixed by
# the rank (so it can be found in interleaved logs), and ends the process with `os._exit(1)`, skipping any
# cleanup that could block. torchrun sees a worker exit with an error and stops the remaining workers at
# once; under plain `srun`, `--kill-on-bad-exit=1` does the same. tests/test_ep.py runs two processes where
# rank 1 raises while rank 0 waits in an all-reduce, and checks that the job ends within seconds with rank 1's
# traceback; it also checks that a collective that never completes raises after `timeout_s`.

# %%
#| export
def run_ranked(fn, *args, **kwargs):
    "Call `fn(*args, **kwargs)`; if it raises, print the traceback prefixed with the rank and exit(1) at once."
    try:
        return fn(*args, **kwargs)
    except Exception:
        rank = dist.get_rank() if dist.is_initialized() else launch_env()["rank"]
        sys.stdout.flush()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in traceback.format_exc().splitlines()))
        sys.stderr.flush()
        os._exit(1)

# %% [markdown]
# ## Running on SLURM
#
# Two ways, both ending in `init_distributed`:
#
# ```bash
# #!/bin/bash
# #SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=64
# # one torchrun per node; torchrun starts 8 workers and sets RANK/WORLD_SIZE/LOCAL_RANK
# head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
# srun --kill-on-bad-exit=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 \
#     --rdzv-backend c10d --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" \
#     -m pith_lit.train configs/qwen3-30b-a3b.toml --set parallel.ep=8 --set parallel.dp=2
# ```
#
# or one task per GPU and no torchrun (`#SBATCH --ntasks-per-node=8`, then
# `srun --kill-on-bad-exit=1 python -m pith_lit.train ...`): each task reads `SLURM_PROCID`, `SLURM_NTASKS`
# and `SLURM_LOCALID`, and rendezvouses at the first node of the job on port 20000 + job id mod 20000.
