# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Checkpoints
#
# A run must survive being killed at any moment and resume as if nothing had happened.

# %% [markdown]
# So a checkpoint holds everything the next step depends on:
#
# - the **model** and the **optimizer** state (AdamW's moments and step counts);
# - the trainer's **extras**: a scheduler, any counter; anything with `state_dict()`/`load_state_dict()`, or a
#   plain value;
# - the **step**, which is also the data position, because the dataset is a pure function of the step;
# - every **random stream** a step may draw from: torch's CPU generator, the current CUDA device's
#   generator, numpy's and Python's `random`, per rank;
# - a small `meta.json` with the step, the installed pith_lit's version ("not installed" when it runs from a checkout
#   on `PYTHONPATH`), the world size, and the model's *signature*:
#   its config (`model_type` and every field) and a hash of its parameter names and shapes, so that
#   `load` can refuse a checkpoint of another model before touching anything.
#
# The tensors are written with `torch.distributed.checkpoint` (DCP). DCP saves **sharded and in parallel**:
# every rank writes only the pieces it owns (an FSDP2 shard, a pipeline stage's layers, an expert
# group) to its own file, with no gather onto one rank. Its `.metadata` file records, for every tensor, the
# global shape and which byte range of which file holds which slice. That index is what makes a
# checkpoint **reshardable**: a load plans its reads from the index against whatever layout the loading
# run has, so a checkpoint written by 8 FSDP ranks loads into 4, or into one plain process, unchanged.
# The same calls work without any process group (one CPU process), which is how this notebook runs.

# %%
#| default_exp train.checkpoint

# %%
#| export
import hashlib
import json
import os
import random
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from pith_lit.train.config import ExistingFile, InvalidInput, MissingFile

# %%
import tempfile
import time

# %% [markdown]
# ## Ranks without a process group
#
# Every collective below is skipped when no process group is initialised, so the single-process path is
# the distributed path with one rank.

# %%
#| export
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier():
    if _distributed():
        dist.barrier()


def _gathered(obj) -> list:
    "`obj` from every rank, in rank order; `[obj]` without a process group."
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _dcp(fn, state: dict, path: Path):
    "Call `dcp.save` or `dcp.load`. Without a process group DCP warns that it assumes one process: intended here."
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        fn(state, checkpoint_id=path)

# %% [markdown]
# ## Random streams
#
# Dropout, random data augmentation or a sampled router draw from the global generators, so resuming
# exactly means restoring them. The states are stored as tensors, tuples and numbers, which
# `torch.load(weights_only=True)` accepts, so reading a checkpoint never unpickles arbitrary objects.
# Only the current CUDA device's generator is saved: under torchrun each rank owns one device, and
# asking for all devices would create a CUDA context on each of them from every rank.

# %%
#| export
def rng_state() -> dict:
    "The states of torch's CPU and current-CUDA-device generators, numpy's global one and Python's `random`."
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "python": random.getstate()}


def set_rng_state(state: dict):
    "Restore what `rng_state` returned. A checkpoint written without CUDA leaves the CUDA generator as it is."
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])

# %% [markdown]
# Check: draw from every stream, restore the state through a `weights_only` round trip, draw again.

# %%
def draws():
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)],
            np.random.randn(1).tolist())  # randn exercises numpy's cached-gaussian fields

with tempfile.TemporaryDirectory() as d:
    np.random.randn(1)  # leave a cached gaussian in numpy's state
    torch.save(rng_state(), f"{d}/rng.pt")
    first = draws()
    set_rng_state(torch.load(f"{d}/rng.pt", weights_only=True))
    assert draws() == first
first[0]

# %% [markdown]
# ## The model's signature
#
# Loading a checkpoint into a different model must fail before anything is overwritten, and say what
# differs. The signature is the model config (a dict holding `model_type` and every field) and a hash of
# the parameter names and **global** shapes. Names come from `get_model_state_dict`, which gives the
# canonical names (without the `_orig_mod.` of `torch.compile` or FSDP's wrapper prefixes) and, for FSDP2,
# DTensors whose `.shape` is the global shape, so the signature does not depend on how the model is
# sharded. With pipeline parallelism each rank holds some of the layers, so the names are gathered from
# all ranks.
#
# `meta.json` keeps only the hash; when it differs, the names and shapes to compare against come from
# DCP's own index, which already lists every tensor with its global shape.

# %%
#| export
def _param_shapes(model_sd: dict) -> dict[str, list[int]]:
    "Name → global shape of every tensor in the model state dict, gathered from all ranks."
    shapes = {name: list(t.shape) for name, t in model_sd.items()}
    return {name: shape for part in _gathered(shapes) for name, shape in part.items()}


def params_hash(shapes: dict[str, list[int]]) -> str:
    "SHA-256 of the sorted (name, shape) list."
    return hashlib.sha256(json.dumps(sorted(shapes.items())).encode()).hexdigest()

# %% [markdown]
# Check: the hash ignores order and sees a changed shape or name.

# %%
h = params_hash({"a.weight": [4, 2], "b": [3]})
assert h == params_hash({"b": [3], "a.weight": [4, 2]})
assert h != params_hash({"a.weight": [4, 3], "b": [3]}) and h != params_hash({"a.w": [4, 2], "b": [3]})

# %% [markdown]
# ## Atomic saves
#
# A save can be killed at any point: a pre-emption, an out-of-memory kill, a node failure. The rule is
# that a directory named `step_NNNNNNNN` is always complete:
#
# 1. everything is written under `ckpt/.tmp_step_NNNNNNNN`: DCP's shard files and `.metadata` (DCP fsyncs
#    each), one RNG file per rank (fsynced); each rank hashes the files it wrote (see *Checksums* below), and
#    rank 0 gathers the checksums and writes them into `meta.json`, **last**, once every rank is done;
# 2. rank 0 fsyncs the directory and **renames** it to `step_NNNNNNNN`. A rename within one file system is
#    atomic, and fsyncing the parent makes it durable;
# 3. older checkpoints beyond `keep` are deleted: each is first renamed to `.tmp_*` and then removed, so a
#    kill mid-delete leaves a `.tmp_*` directory, never a half-deleted `step_*` one.
#
# `latest()` (below) looks only at `step_*` directories holding `meta.json`, so a killed save is invisible,
# and the next save removes every leftover `.tmp_*`. On several nodes `run_dir` must be on a shared file
# system, as DCP requires anyway.
#
# Two choices are refused rather than guessed at: overwriting an existing `step_*` directory (it might be
# the only good copy), and saving an optimizer that has taken no step. For the latter,
# `get_optimizer_state_dict` would create the state with a zero-learning-rate step, which for AdamW starts
# the step count at 1 and changes every later update.

# %%
#| export
def _fsync(path: Path):
    "Flush a file, or a directory's entries (new files, renames), to disk."
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(ckpt: Path) -> list[Path]:
    "The finished checkpoints in `ckpt`, oldest first: `step_NNNNNNNN` directories holding meta.json."
    found = [p for p in ckpt.glob("step_*") if p.name[5:].isdigit() and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _rng_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / f"rng_rank{rank:05d}.pt"

# %% [markdown]
# ## Checksums
#
# Sizes catch a truncated file, but not damage of the same size: a flipped bit on a failing disk, a bad copy
# between file systems, a storage bug. DCP reads such bytes back as tensors without complaint, the run goes on
# from wrong weights or moments, and when it hits NaN the trainer's advice (resume from the latest checkpoint,
# "the last good one") sends it straight back to the damaged file. So every saved file gets a checksum.
#
# At save, each rank hashes the files it has just written (its DCP shard `__R_*.distcp` and its RNG file, most
# likely still in its page cache), the checksums are gathered to rank 0, and rank 0 adds `.metadata` and
# records them all in `meta.json` under `"files"`: `{name: {"size": bytes, "sha256": hex}}`. `meta.json`
# cannot hold its own checksum in a file list, so it carries `"meta_sha256"`, the SHA-256 of its other fields:
# a flipped digit in `"step"` or in the model config must not load either.
#
# Hashing reads every byte, so it is streamed in 4 MiB chunks through one buffer, and it costs time: the cell
# below measures it. On the CPU this was written on (an AMD EPYC with the SHA extensions) `hashlib.sha256` runs
# at about 1.1–1.2 GB/s per core and `blake2b` at about 0.55–0.6 GB/s, so the checksum is SHA-256. A save hashes
# each rank's files on that rank, all ranks at once: about 0.9 s per GB a rank wrote, added to every save. A
# verification shares the files among the ranks (the largest first, each to the least loaded rank) and hashes
# up to 8 files at once per rank (hashlib releases the GIL), so a 100 GB checkpoint read back by 8 ranks costs
# about 100 / (8 × 1.1) ≈ 11 s at resume if the file system keeps up; one process checking a checkpoint of many
# ranks pays for the whole read.

# %%
buf = os.urandom(64 << 20)
for name in ("sha256", "blake2b"):
    t = time.perf_counter()
    hashlib.new(name, buf).digest()
    print(f"{name}: {len(buf) / (time.perf_counter() - t) / 1e6:.0f} MB/s")

# %%
#| export
CHECKSUM = "sha256"  # the faster of sha256 and blake2b on the CPUs measured above
_CHUNK = 4 << 20     # bytes read per hashing step


def _digest(path: Path, algo: str = CHECKSUM) -> str:
    "The hex checksum of the file `path`, read in chunks into one buffer."
    h, buf = hashlib.new(algo), bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _hash_all(jobs: list[tuple[Path, str]]) -> list[str]:
    "`_digest` of each (path, algorithm), up to 8 files at once."
    if not jobs:
        return []
    with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(lambda job: _digest(*job), jobs))


def _digests(paths: list[Path]) -> dict[str, dict]:
    "File name → {'size': bytes, CHECKSUM: hex} for each path, as `meta.json` records them."
    hexes = _hash_all([(p, CHECKSUM) for p in paths])
    return {p.name: {"size": p.stat().st_size, CHECKSUM: h} for p, h in zip(paths, hexes)}


def _meta_hash(meta: dict) -> str:
    "The SHA-256 of meta.json's fields other than `meta_sha256`, which holds it."
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()

# %% [markdown]
# ## What is saved
#
# The state handed to DCP has four parts: the model's state dict, the optimizer's (flattened to one entry per
# parameter name, so that pipeline ranks, which hold different parameters, never write different values under a
# shared key such as `param_groups.0.params`), the extras (each Stateful one as its state dict), and nothing
# else. In a training run every parameter and every AdamW moment is a DTensor (FSDP2, engine/36): it records its
# global shape and which rows this rank holds, experts included (they are divided along the expert axis, then
# sharded over the data ranks). DCP writes each piece once and can load the checkpoint at any other layout: other
# pipeline, expert- or data-parallel sizes, or one process with plain tensors.

# %%
#| export
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model, optimizer, extra: dict) -> dict:
    "The dict DCP saves or loads into: model, flattened optimizer, extras (Stateful ones as state dicts)."
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=_FLAT)}
    state.update({k: v.state_dict() if isinstance(v, Stateful) else v for k, v in extra.items()})
    return state

# %%
#| export
try:   # the installed pith_lit's version, for meta.json
    VERSION = version("pith_lit")
except PackageNotFoundError:   # run from a checkout on PYTHONPATH
    VERSION = "not installed"


def _need_model_type(model_config: dict):
    if "model_type" not in model_config:
        raise ValueError(f"model_config has no 'model_type' (keys: {sorted(model_config)}); pass the whole "
                         "model config as a dict, e.g. dataclasses.asdict(config.model)")


def _write(run_dir, step: int, state: dict, shapes: dict, model_config: dict, keep: int, rng: dict | None,
           layout: dict | None = None) -> Path:
    "Write `state` as `run_dir/ckpt/step_{step:08d}` by the three steps above; no `rng`: a weights-only checkpoint."
    ckpt = Path(run_dir) / "ckpt"
    final, tmp = ckpt / f"step_{step:08d}", ckpt / f".tmp_step_{step:08d}"
    if final.exists():
        raise ExistingFile(f"{final} already exists and is never overwritten; resume from the latest "
                              "checkpoint, or use another run.dir")
    rank = _rank()
    if rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
        for stale in ckpt.glob(".tmp_*"):  # left by a killed save or delete
            shutil.rmtree(stale)
        tmp.mkdir()
    _barrier()
    _dcp(dcp.save, state, tmp)
    mine = sorted(tmp.glob(f"__{rank}_*.distcp"))  # the shard files DCP wrote for this rank
    if rng is not None:
        mine.append(_rng_file(tmp, rank))
        torch.save(rng, mine[-1])
        _fsync(mine[-1])
    # each rank hashes its own files; gathering the results also waits until every rank's files are on disk
    files = {name: entry for part in _gathered(_digests(mine)) for name, entry in part.items()}
    if rank == 0:
        files.update(_digests(sorted(p for p in tmp.iterdir() if p.name not in files)))  # .metadata, any other
        meta = {"step": step, "pith_lit_version": VERSION, "world_size": _world_size(), "layout": layout,
                "model_config": model_config, "params_sha256": params_hash(shapes)}
        if rng is None:
            meta["weights_only"] = True
        meta["files"] = dict(sorted(files.items()))
        meta = json.loads(json.dumps(meta))  # as it reads back (tuples become lists), so that its hash matches
        meta["meta_sha256"] = _meta_hash(meta)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        _fsync(tmp / "meta.json")
        _fsync(tmp)
        tmp.rename(final)
        _fsync(ckpt)
        others = [p for p in _complete(ckpt) if p != final]
        for old in others[:max(len(others) - (keep - 1), 0)]:
            trash = old.with_name(".tmp_delete_" + old.name)
            old.rename(trash)
            shutil.rmtree(trash)
    _barrier()  # no rank returns before the checkpoint exists
    return final


def save(run_dir, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict | None = None, model_config: dict, keep: int = 2, layout: dict | None = None) -> Path:
    """Write `run_dir/ckpt/step_{step:08d}` atomically and keep the newest `keep` checkpoints.

    `extra` maps names to objects with `state_dict()`/`load_state_dict()` (a scheduler, a counter) or to plain
    values (numbers, strings, tensors). `model_config` is the model's config as a dict, including `model_type`.
    `layout` (e.g. the parallel sizes) is recorded in meta.json for the log of a run that loads it elsewhere. Every
    rank calls this; returns the checkpoint's path."""
    extra = extra or {}
    rng = rng_state()  # first, so that nothing below can advance a generator before it is recorded
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint being written (keep >= 1)")
    _need_model_type(model_config)
    bad = sorted(k for k in extra if k in ("model", "optim") or "." in k)
    if bad:
        raise ValueError(f"extra keys {bad} are not allowed: 'model' and 'optim' are taken, and DCP joins "
                         "nested keys with '.'; rename them")
    if not optimizer.state:
        raise ValueError(f"save(step={step}) before the optimizer's first step: it has no state to save, and "
                         "creating one would change training. Save after optimizer.step().")
    state = _state(model, optimizer, extra)
    return _write(run_dir, step, state, _param_shapes(state["model"]), model_config, keep, rng, layout)


def saved_layout(path) -> dict | None:
    "The `layout` that checkpoint `path` was saved with (None if it recorded none)."
    return _read_meta(Path(path)).get("layout")

# %% [markdown]
# ## Verifying a checkpoint, and the latest good one
#
# `_check_files` runs before anything is read, by `latest` and by `load`. It reads `meta.json` (a file that is
# not JSON, lacks a field or fails its own checksum names the checkpoint, instead of a raw `JSONDecodeError`),
# then checks every file `meta.json` lists: there, of the recorded size, then of the recorded checksum. The
# hashing is shared among the ranks and the mismatches gathered, so every rank reaches the same verdict and none
# goes on to load alone. Then DCP's index is read and the byte ranges it points to are checked against the
# file sizes, which is all a checkpoint saved before checksums existed gets: it still loads, silently.
#
# A damaged checkpoint raises `DamagedCheckpoint` (a `ValueError`), a missing file `MissingFile` (a
# `FileNotFoundError`); both are the config's `UserError`, and both name the checkpoint and the file.
#
# `latest(run_dir)` returns the newest checkpoint that passes. A damaged newer one is renamed to
# `damaged_step_NNNNNNNN` beside it, never deleted: the user can inspect it, the rotation of `keep` never
# counts or removes it, and the resumed run can save that step again. One line per damaged checkpoint says
# what failed and where it went. When no good checkpoint is left, `latest` raises, leaving everything where
# it is: starting from scratch is the user's call. The trainer's resume is `load(latest(run_dir))`, so it
# falls back without a change; to hash only once, `latest` remembers the files it has just verified (their
# names, sizes and modification times) and the next `load` of that checkpoint skips the hashing.

# %%
#| export
class DamagedCheckpoint(InvalidInput):
    "A checkpoint whose files differ from what its save recorded, or whose meta.json or index cannot be read."


def _damaged(path: Path, reason: str, kind: type = DamagedCheckpoint) -> Exception:
    "The error for damaged checkpoint `path`, with `.path` and `.reason` set for `latest`'s one-line report."
    e = kind(f"checkpoint {path} is damaged: {reason}. Nothing was loaded and the checkpoint is left as it is; "
             f"load an earlier one from {path.parent} (checkpoint.latest(run_dir) falls back by itself)")
    e.path, e.reason = path, reason
    return e


_META_FIELDS = {"step": int, "world_size": int, "model_config": dict, "params_sha256": str}


def _algo(entry) -> str | None:
    "The checksum algorithm of a `files` entry of meta.json."
    return next((k for k in entry if k in hashlib.algorithms_guaranteed), None) if isinstance(entry, dict) else None


def _read_meta(path: Path) -> dict:
    "meta.json of checkpoint `path`, refused by name if it is not JSON, lacks a field or fails its checksum."
    try:
        meta = json.loads((path / "meta.json").read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _damaged(path, f"its meta.json is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise _damaged(path, "its meta.json is not a JSON object")
    bad = [k for k, kind in _META_FIELDS.items() if type(meta.get(k)) is not kind]
    files = meta.get("files", {})  # absent in checkpoints saved before checksums
    if not (isinstance(files, dict) and all(_algo(e) and type(e.get("size")) is int for e in files.values())):
        bad.append("files")
    if bad:
        raise _damaged(path, f"its meta.json lacks {', '.join(bad)} or holds a wrong value there")
    if "meta_sha256" in meta and meta["meta_sha256"] != _meta_hash(meta):
        raise _damaged(path, "its meta.json does not match its own checksum: it was changed after the save "
                             "(if you edited it on purpose, delete its meta_sha256 field)")
    return meta


_VERIFIED: set = set()  # (checkpoint, fingerprint) that latest() has just verified, for the load that follows


def _fingerprint(path: Path) -> tuple:
    "The checkpoint and the name, size and modification time of each of its files."
    return str(path.absolute()), tuple(sorted((f.name, s.st_size, s.st_mtime_ns) for f in path.iterdir()
                                              for s in [f.stat()]))


def _check_sums(path: Path, files: dict, remember: bool):
    "Compare the files meta.json lists with their sizes, then their checksums (shared among the ranks)."
    for name, entry in sorted(files.items()):
        f = path / name
        if not f.is_file():
            raise _damaged(path, f"{f} is missing", MissingFile)
        if f.stat().st_size != entry["size"]:
            raise _damaged(path, f"{f} has {f.stat().st_size} bytes, {entry['size']} when it was saved")
    if not files:  # saved before checksums existed
        return
    key = _fingerprint(path)
    hit = key in _VERIFIED
    _VERIFIED.discard(key)
    if all(_gathered(hit)):  # latest() has just hashed these very files, on every rank
        return
    load, mine = [0] * _world_size(), []  # the largest file first, each to the least loaded rank
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = load.index(min(load))
        load[r] += files[name]["size"] + 1
        if r == _rank():
            mine.append(name)
    hexes = _hash_all([(path / n, _algo(files[n])) for n in mine])
    wrong = [(n, h) for n, h in zip(mine, hexes) if h != files[n][_algo(files[n])]]
    wrong = sorted(w for part in _gathered(wrong) for w in part)
    if wrong:
        (name, now), entry = wrong[0], files[wrong[0][0]]
        algo = _algo(entry)
        more = f" (nor do {', '.join(n for n, _ in wrong[1:])})" if len(wrong) > 1 else ""
        raise _damaged(path, f"{path / name} does not match its {algo} checksum (saved: {entry['size']} bytes, "
                             f"{algo} {entry[algo][:16]}…; now {now[:16]}…){more}")
    if remember:
        _VERIFIED.add(key)


def _check_files(path: Path, remember: bool = False):
    """Refuse an incomplete or damaged checkpoint, naming it and the file. Returns (meta, DCP index).

    `remember`: let the next call for this checkpoint skip the hashing if its files stay the same."""
    if not (path / "meta.json").is_file():
        raise MissingFile(f"{path} is not a complete checkpoint: it has no meta.json (a killed save "
                                "leaves a .tmp_* directory; checkpoint.latest(run_dir) finds the newest complete one)")
    meta = _read_meta(path)
    _check_sums(path, meta.get("files", {}), remember)  # saved before checksums: only the sizes below
    if not (path / ".metadata").is_file():
        raise _damaged(path, f"{path / '.metadata'} is missing", MissingFile)
    try:
        index = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise _damaged(path, f"its DCP index {path / '.metadata'} cannot be read ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]})") from e
    needed = {}  # file → bytes the index reads from it
    for info in index.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    if not meta.get("weights_only"):
        needed.update({_rng_file(path, r).name: 1 for r in range(meta["world_size"])})
    for name, size in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            raise _damaged(path, f"{f} is missing", MissingFile)
        if f.stat().st_size < size:
            raise _damaged(path, f"{f} has {f.stat().st_size} bytes, its index reads up to byte {size}")
    return meta, index


def _set_aside(path: Path) -> str:
    """Rename damaged checkpoint `path` to `damaged_step_NNNNNNNN` (`.1`, `.2`… if taken) beside it, on rank 0.
    Returns what became of it, for `latest`'s report."""
    done = None
    if _rank() == 0:
        aside, i = path.with_name("damaged_" + path.name), 0
        while aside.exists():
            i += 1
            aside = path.with_name(f"damaged_{path.name}.{i}")
        try:
            path.rename(aside)
            _fsync(path.parent)
            done = f"kept as {aside} for inspection"
        except OSError as e:  # a read-only run directory, say: leave it where it is
            done = f"left where it is (renaming it failed: {e})"
    return _gathered(done)[0]  # also keeps the ranks together


def latest(run_dir, *, say=print, verify: bool = True) -> Path | None:
    """The newest checkpoint of the run whose files match what its save recorded, or None if it has none.

    Leftovers of killed saves (`.tmp_*`) are ignored. A damaged newer checkpoint is renamed `damaged_step_N`
    (kept, never deleted) and reported in one line through `say` (on rank 0); with no good one left,
    `DamagedCheckpoint` is raised and nothing is renamed. Under a process group every rank calls this.
    `verify=False`: the newest complete one, unchecked (no hashing, no collective), to name it, not to load it."""
    ckpt = Path(run_dir) / "ckpt"
    found = _complete(ckpt)
    if not verify:
        return found[-1] if found else None
    damaged, good = [], None
    for path in reversed(found):
        try:
            _check_files(path, remember=True)
        except (DamagedCheckpoint, FileNotFoundError) as e:
            damaged.append((path, getattr(e, "reason", str(e))))
            continue
        good = path
        break
    if damaged and good is None:
        (path, reason), rest = damaged[0], [p.name for p, _ in damaged[1:]]
        also = f" (so are {', '.join(rest)})" if rest else ""
        e = DamagedCheckpoint(
            f"checkpoint {path} is damaged: {reason}{also}; there is no earlier good checkpoint to fall back to. "
            f"Nothing was changed: move {'them' if rest else 'it'} out of {ckpt} to start this run again from "
            "step 0, or set run.dir to a new directory")
        e.path, e.reason = path, reason
        raise e
    for path, reason in damaged:
        done = _set_aside(path)
        if _rank() == 0:
            say(f"checkpoint {path} is damaged: {reason}; {done}; falling back to the previous good one {good}")
    return good

# %% [markdown]
# A stand-in for training: a tiny MLP with dropout (the global torch generator), AdamW and a warm-up
# schedule. Each step draws its batch from a generator seeded by the step, as the real dataset does, and
# adds noise from numpy and from Python's `random`, so every stream matters for the losses.

# %%
def make(hidden=16, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(hidden, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched, {"model_type": "mlp_demo", "hidden": hidden}

def train(model, opt, sched, start, stop):
    losses = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        y = y + float(np.random.randn()) * 0.1 + random.random() * 0.1
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses

# %% [markdown]
# Save three times with `keep=2`: only the two newest remain, and a leftover `.tmp_*` directory (what a
# killed save leaves) is ignored by `latest` and removed by the next save.

# %%
run_dir = Path(tempfile.mkdtemp())
model, opt, sched, mcfg = make()
for step in (2, 4, 6):
    train(model, opt, sched, step - 2, step)
    save(run_dir, step, model=model, optimizer=opt, extra={"sched": sched, "tokens": step * 16},
         model_config=mcfg, keep=2)
assert [p.name for p in _complete(run_dir / "ckpt")] == ["step_00000004", "step_00000006"]
(run_dir / "ckpt/.tmp_step_00000008").mkdir()  # as if a save of step 8 had been killed
assert latest(run_dir) == run_dir / "ckpt/step_00000006"
sorted(os.listdir(latest(run_dir))), json.loads((latest(run_dir) / "meta.json").read_text())

# %%
train(model, opt, sched, 6, 8)
save(run_dir, 8, model=model, optimizer=opt, extra={"sched": sched, "tokens": 8 * 16}, model_config=mcfg)
assert sorted(os.listdir(run_dir / "ckpt")) == ["step_00000006", "step_00000008"]
shutil.rmtree(run_dir)

# %% [markdown]
# ## Loading
#
# `load` checks before it reads: `_check_files` above (complete, readable `meta.json`, every file there, of
# its size and checksum, every byte range DCP's index points to inside its file), so a damaged checkpoint fails
# with the path of what is wrong instead of deep inside DCP, or, worse, not at all. Then the signature is
# compared, and every difference is listed. Only then are the states loaded: `dcp.load` fills the state
# dicts in place, `set_model_state_dict` and `set_optimizer_state_dict` hand them to the model and the
# optimizer, the extras that have `load_state_dict` get theirs, and plain values are written back into `extra`.
#
# If the world size changed since the save, rank r takes the RNG states of saved rank r mod the old world
# size: a resharded run cannot repeat the old random streams exactly anyway.
#
# `load_weights` is the same for the model alone: the same checks, then only the model's tensors are read.

# %%
#| export
def _differences(meta: dict, index, model_config: dict, shapes: dict, extra: dict | None) -> list[str]:
    "What differs between the checkpoint and this run, one line each; `extra` None: the model only."
    saved, now = meta["model_config"], json.loads(json.dumps(model_config))  # as JSON: tuples become lists
    if saved.get("model_type") != now.get("model_type"):
        return [f"model_type: checkpoint {saved.get('model_type')!r}, this run {now.get('model_type')!r}"]
    out = [f"config {k}: checkpoint {saved.get(k, '(absent)')!r}, this run {now.get(k, '(absent)')!r}"
           for k in sorted(saved.keys() | now.keys()) if saved.get(k, "(absent)") != now.get(k, "(absent)")]
    if meta["params_sha256"] != params_hash(shapes):
        stored = {k[len("model."):]: list(v.size) for k, v in index.state_dict_metadata.items()
                  if k.startswith("model.")}
        for name in sorted(stored.keys() | shapes.keys()):
            a, b = stored.get(name, "(absent)"), shapes.get(name, "(absent)")
            if a != b:
                out.append(f"parameter {name}: checkpoint shape {a}, this run {b}")
    if extra is not None:
        top = {k.split(".")[0] for k in index.state_dict_metadata} - {"model", "optim"}
        out += [f"extra {k!r}: in the checkpoint, not passed to load" for k in sorted(top - extra.keys())]
        out += [f"extra {k!r}: passed to load, not in the checkpoint" for k in sorted(extra.keys() - top)]
    return out


def _refuse(path: Path, problems: list[str]):
    if problems:
        raise InvalidInput(f"checkpoint {path} does not match this run: " + "; ".join(problems) +
                           ". Resume with the config the checkpoint was written with, or set another run.dir "
                           "to start a new run.")

# %%
#| export
def load_weights(path, *, model: torch.nn.Module, model_config: dict) -> int:
    """Restore only the model's weights from checkpoint `path` (a full or a weights-only one); return its step.

    The same checks as `load` for the model; no optimizer, extras or RNG are read or changed."""
    path = Path(path)
    return _load_model(path, *_check_files(path), model, model_config)


def _load_model(path: Path, meta: dict, index, model, model_config: dict) -> int:
    "`load_weights` after the files are checked."
    model_sd = get_model_state_dict(model)
    _refuse(path, _differences(meta, index, model_config, _param_shapes(model_sd), None))
    _dcp(dcp.load, {"model": model_sd}, path)
    set_model_state_dict(model, model_sd)
    return meta["step"]


def load(path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict | None = None,
         model_config: dict) -> int:
    """Restore model, optimizer, `extra` and every RNG from checkpoint `path`; return its step.

    Refuses a damaged checkpoint (`DamagedCheckpoint`, or `FileNotFoundError` for a missing file) or one of
    another model (`ValueError`), before anything is changed. Plain values in `extra` are replaced in the dict;
    the others get `load_state_dict`. A weights-only checkpoint (see `save_weights`) restores the model alone
    and returns step 0. Every rank calls this."""
    path, extra = Path(path), extra if extra is not None else {}
    meta, index = _check_files(path)
    if meta.get("weights_only"):
        return _load_model(path, meta, index, model, model_config)
    state = _state(model, optimizer, extra)
    _refuse(path, _differences(meta, index, model_config, _param_shapes(state["model"]), extra))
    _dcp(dcp.load, state, path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_FLAT)
    for k, v in extra.items():
        if isinstance(v, Stateful):
            v.load_state_dict(state[k])
        else:
            extra[k] = state[k]
    saved_rank = _rank() % meta["world_size"]
    set_rng_state(torch.load(_rng_file(path, saved_rank), weights_only=True))
    return meta["step"]

# %% [markdown]
# ## Check: resuming is exact
#
# Eight steps straight, against four steps, a save, a fresh model and optimizer (built from another seed,
# with every generator scrambled), a load, and four more steps. The losses must agree bitwise at every
# step, and so must the final weights.

# %%
run_dir = Path(tempfile.mkdtemp())
torch.manual_seed(1); np.random.seed(1); random.seed(1)
model, opt, sched, mcfg = make()
straight = train(model, opt, sched, 0, 8)
final_weights = {k: v.clone() for k, v in model.state_dict().items()}

torch.manual_seed(1); np.random.seed(1); random.seed(1)
model, opt, sched, mcfg = make()
first = train(model, opt, sched, 0, 4)
save(run_dir, 4, model=model, optimizer=opt, extra={"sched": sched, "tokens": 64}, model_config=mcfg)

torch.manual_seed(99); np.random.seed(99); random.seed(99)
model, opt, sched, mcfg = make(seed=7)
extra = {"sched": sched, "tokens": 0}
step = load(latest(run_dir), model=model, optimizer=opt, extra=extra, model_config=mcfg)
assert step == 4 and extra["tokens"] == 64 and sched.last_epoch == 4
resumed = first + train(model, opt, sched, step, 8)
assert resumed == straight, (resumed, straight)
assert all(torch.equal(final_weights[k], v) for k, v in model.state_dict().items())
straight

# %% [markdown]
# ## Check: the wrong model is refused
#
# A wider model, and one that claims the same config but has another shape (a code change that renamed
# or resized a parameter): each fails with what differs and what to do, and nothing is loaded.

# %%
wide, wide_opt, _, wide_cfg = make(hidden=32)
train(wide, wide_opt, torch.optim.lr_scheduler.LambdaLR(wide_opt, lambda s: 1.0), 0, 1)
try:
    load(latest(run_dir), model=wide, optimizer=wide_opt, extra={"sched": sched, "tokens": 0}, model_config=wide_cfg)
    raise AssertionError("a wider model was loaded")
except ValueError as e:
    msg = str(e)
print(msg)
assert "config hidden: checkpoint 16, this run 32" in msg and "parameter 0.weight: checkpoint shape [16, 8], " \
       "this run [32, 8]" in msg and "another run.dir" in msg

# %%
try:
    load(latest(run_dir), model=wide, optimizer=wide_opt, extra={"sched": sched, "tokens": 0}, model_config=mcfg)
    raise AssertionError("a wider model was loaded")
except ValueError as e:
    msg = str(e)
problems = msg.split("does not match this run: ", 1)[1].split("; ")
assert "config" not in problems[0] and "parameter 3.weight: checkpoint shape [1, 16], this run [1, 32]" in msg
problems[:2]

# %% [markdown]
# ## Weights-only checkpoints
#
# A run can also start from weights that no run of ours trained: a Hugging Face model imported by
# `python -m pith_lit.convert hf2pith` (train/hf). `save_weights` writes such a start as an ordinary checkpoint
# directory, `ckpt/step_00000000`, holding the model alone: no optimizer state, extras or RNG files, and
# `"weights_only": true` in its meta.json. The trainer finds it with `latest()` as usual, and `load` restores
# the model from it, checks it against the model config like any checkpoint, and returns step 0, leaving the
# optimizer, the extras and the random streams as the fresh run made them. It is only a start: a run directory
# that already holds checkpoints is refused, because `latest()` would never choose step 0 over them.
#
# `load_weights` is the other direction: the model's weights alone out of any checkpoint, full or weights-only,
# for exporting a trained model (`python -m pith_lit.convert pith2hf`).

# %%
#| export
def save_weights(run_dir, *, model: torch.nn.Module, model_config: dict) -> Path:
    """Write the weights-only checkpoint `run_dir/ckpt/step_00000000` that a run starts from; returns its path.

    `run_dir` must hold no checkpoint yet. Every rank calls this."""
    _need_model_type(model_config)
    done = _complete(Path(run_dir) / "ckpt")
    if done:
        raise ExistingFile(f"{run_dir} already holds checkpoints ({', '.join(p.name for p in done)}); "
                              "weights to start a run from go into a new run directory")
    model_sd = get_model_state_dict(model)
    return _write(run_dir, 0, {"model": model_sd}, _param_shapes(model_sd), model_config, 1, None)

# %% [markdown]
# Check: the trained model of the resume check above, saved weights-only, goes into a fresh model, optimizer
# and scheduler. The weights arrive; the optimizer has no state, the scheduler is at step 0 and the random
# streams go on from where they were. A wider model is refused as for a full checkpoint, and so is a second
# start in the same run directory. `load_weights` from the full checkpoint of step 4 leaves the optimizer alone.

# %%
start_dir = Path(tempfile.mkdtemp())
save_weights(start_dir, model=model, model_config=mcfg)
path = latest(start_dir)
assert path.name == "step_00000000" and sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "meta.json"]
assert json.loads((path / "meta.json").read_text())["weights_only"] is True

fresh, fresh_opt, fresh_sched, _ = make(seed=11)
torch.manual_seed(5)
expected = torch.rand(3)
torch.manual_seed(5)
extra = {"sched": fresh_sched, "tokens": 0}
assert load(path, model=fresh, optimizer=fresh_opt, extra=extra, model_config=mcfg) == 0
assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
assert not fresh_opt.state and fresh_sched.last_epoch == 0 and extra["tokens"] == 0
assert torch.equal(torch.rand(3), expected)  # the random streams were not touched

try:
    load(path, model=wide, optimizer=wide_opt, extra={}, model_config=wide_cfg)
    raise AssertionError("a wider model was loaded")
except ValueError as e:
    assert "config hidden: checkpoint 16, this run 32" in str(e)
try:
    save_weights(start_dir, model=model, model_config=mcfg)
    raise AssertionError("a second start was written")
except FileExistsError as e:
    assert "already holds checkpoints (step_00000000)" in str(e)

step4 = run_dir / "ckpt/step_00000004"
fresh, fresh_opt, _, _ = make(seed=12)
assert load_weights(step4, model=fresh, model_config=mcfg) == 4 and not fresh_opt.state
torch.manual_seed(1); np.random.seed(1); random.seed(1)
reference, reference_opt, reference_sched, _ = make()
train(reference, reference_opt, reference_sched, 0, 4)  # the first half of the resume check again
assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), reference.state_dict().values()))
shutil.rmtree(start_dir)

# %% [markdown]
# ## Check: a damaged checkpoint is refused by name
#
# A shard file removed by hand (or lost by a failing disk) is named in the error.

# %%
bad = latest(run_dir)
(bad / "__0_0.distcp").unlink()
try:
    load(bad, model=model, optimizer=opt, extra={"sched": sched, "tokens": 0}, model_config=mcfg)
    raise AssertionError("a damaged checkpoint was loaded")
except FileNotFoundError as e:
    msg = str(e)
assert str(bad / "__0_0.distcp") in msg
msg

# %%
shutil.rmtree(run_dir)

# %% [markdown]
# ## Check: damage of the same size is caught, and `latest` falls back
#
# Two checkpoints, steps 2 and 4; then one bit flips in the middle of step 4's shard file. The sizes still
# match, so only the checksum sees it. `load` refuses, naming the checkpoint and the file.

# %%
def flip(f: Path):
    "Flip one bit in the middle of file `f`; its size stays the same."
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 1]))

run_dir = Path(tempfile.mkdtemp())
model, opt, sched, mcfg = make()
for step in (2, 4):
    train(model, opt, sched, step - 2, step)
    save(run_dir, step, model=model, optimizer=opt, extra={"sched": sched, "tokens": step * 16}, model_config=mcfg)
ckpt = run_dir / "ckpt"
step2, step4 = ckpt / "step_00000002", ckpt / "step_00000004"
shard = step4 / "__0_0.distcp"
size = shard.stat().st_size
flip(shard)
assert shard.stat().st_size == size
try:
    load(step4, model=model, optimizer=opt, extra={"sched": sched, "tokens": 0}, model_config=mcfg)
    raise AssertionError("a damaged checkpoint was loaded")
except DamagedCheckpoint as e:
    msg = str(e)
assert msg.startswith(f"checkpoint {step4} is damaged: {shard} does not match its sha256 checksum (saved: {size} bytes")
msg

# %% [markdown]
# `latest` falls back to step 2 with one line, and keeps step 4, bit flip and all, as `damaged_step_00000004`. The
# run resumes from step 2 and saves step 4 again.

# %%
damaged_bytes = shard.read_bytes()
assert latest(run_dir) == step2
assert (ckpt / "damaged_step_00000004/__0_0.distcp").read_bytes() == damaged_bytes
model, opt, sched, mcfg = make(seed=3)
assert load(latest(run_dir), model=model, optimizer=opt, extra={"sched": sched, "tokens": 0}, model_config=mcfg) == 2
train(model, opt, sched, 2, 4)
save(run_dir, 4, model=model, optimizer=opt, extra={"sched": sched, "tokens": 64}, model_config=mcfg)
sorted(os.listdir(ckpt))

# %% [markdown]
# A `meta.json` cut short (or otherwise not JSON) names its checkpoint rather than raising a bare
# `JSONDecodeError`, and `latest` treats it as any damage. One edited into other valid JSON fails its own checksum.

# %%
meta_file = step4 / "meta.json"
meta_file.write_bytes(meta_file.read_bytes()[:100])
try:
    load(step4, model=model, optimizer=opt, extra={"sched": sched, "tokens": 0}, model_config=mcfg)
    raise AssertionError("a checkpoint with a broken meta.json was loaded")
except DamagedCheckpoint as e:
    msg = str(e)
print(msg)
assert msg.startswith(f"checkpoint {step4} is damaged: its meta.json is not valid JSON (")
assert latest(run_dir) == step2 and (ckpt / "damaged_step_00000004.1/meta.json").is_file()

meta = json.loads((step2 / "meta.json").read_text())
(step2 / "meta.json").write_text(json.dumps({**meta, "step": 3}))
try:
    load(step2, model=model, optimizer=opt, extra={"sched": sched, "tokens": 0}, model_config=mcfg)
    raise AssertionError("an edited meta.json was loaded")
except DamagedCheckpoint as e:
    assert "its meta.json does not match its own checksum" in str(e)

# %% [markdown]
# Now no good checkpoint is left: `latest` raises one line that names the newest and what to do, and renames nothing.

# %%
before = sorted(os.listdir(ckpt))
try:
    latest(run_dir)
    raise AssertionError("latest() returned a damaged checkpoint")
except DamagedCheckpoint as e:
    msg = str(e)
print(msg)
assert msg.startswith(f"checkpoint {step2} is damaged: its meta.json does not match its own checksum") and \
    "no earlier good checkpoint" in msg and "\n" not in msg and sorted(os.listdir(ckpt)) == before

# %% [markdown]
# A checkpoint saved before checksums existed has neither `files` nor `meta_sha256` in its meta.json: it loads
# as before, checked by size only, without a word.

# %%
(step2 / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("files", "meta_sha256")}))
assert latest(run_dir) == step2
assert load(step2, model=model, optimizer=opt, extra={"sched": sched, "tokens": 0}, model_config=mcfg) == 2
shutil.rmtree(run_dir)

# %% [markdown]
# ## On a GPU
#
# The same round trip with the model and optimizer on the GPU: tensors come back on the device they are
# loaded into, and the CUDA generator is restored along with the others.

# %%
#| cuda
run_dir = Path(tempfile.mkdtemp())
model, opt, sched, mcfg = make()
model.cuda()
model(torch.randn(16, 8, device="cuda")).square().mean().backward()
opt.step()
save(run_dir, 1, model=model, optimizer=opt, extra={"sched": sched}, model_config=mcfg)
expected = torch.rand(4, device="cuda")
fresh, fresh_opt, fresh_sched, _ = make(seed=3)
fresh.cuda()
torch.cuda.manual_seed(5)
assert load(latest(run_dir), model=fresh, optimizer=fresh_opt, extra={"sched": fresh_sched}, model_config=mcfg) == 1
assert torch.equal(torch.rand(4, device="cuda"), expected)
assert all(a.is_cuda and torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
assert all(s["exp_avg"].is_cuda and torch.equal(s["exp_avg"], t["exp_avg"])
           for s, t in zip(fresh_opt.state.values(), opt.state.values()))
shutil.rmtree(run_dir)
