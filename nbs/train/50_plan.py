# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # `python -m pith_lit.plan`: the layouts that fit, before renting the GPUs
#
# The planner of engine/37 on the command line. Given a run config and a number of GPUs it tries every layout of
# that many GPUs (pp × dp_replicate × dp × ep, the config's cp), with each micro-batch size that divides the global
# batch and each recomputation, keeps those the config accepts (train/40's checks: experts divisible by ep, enough
# micro-batches for DualPipeV, ...), and prints the ones predicted to fit the GPU's memory, with their predicted
# peak and, given a measured profile, their predicted tokens/s:
#
# ```bash
# python -m pith_lit.plan configs/qwen3-30b-a3b.toml --gpus 8 --gpu-memory 140
# python -m pith_lit.plan configs/bench-qwen3-30b-a3b.toml --measure runs/profile-qwen3.json   # on one GPU
# python -m pith_lit.plan configs/qwen3-30b-a3b.toml --gpus 64 --profile runs/profile-qwen3.json
# ```
#
# Without `--gpus` it estimates the config's own layout, rank by rank. `--measure FILE` times one layer of each
# kind, the head and the optimizer on this machine's GPU at the config's micro-batch (engine/38 `profile_layers`)
# and writes them to FILE; `--profile FILE` reads such a file (the sequence length should be the config's). With a
# profile, pipelined layouts get the cut `choose_stage_layers` picks. The link model's bandwidths are flags.
# `--check` prints the config's own estimate as one JSON line (benchmarks/plan_measure.sh compares it with a run).
#
# HSDP (`dp_replicate > 1`) is tried only where each replica's shard group fills a node (it replicates across
# nodes); recomputation only where a layout does not fit without it (it costs time and buys nothing else);
# `ep_sync_free` and `cp` stay as the config has them (the link model has no term for the ring's transfers).

# %%
#| default_exp plan

# %%
#| export
import argparse
import json
from dataclasses import asdict

import torch

from pith_lit.engine.planner import GiB, Estimate, estimate
from pith_lit.engine.steptime import Link, Profile, StepTime, choose_stage_layers, profile_layers, step_time
from pith_lit.train.config import (Config, ConfigError, UserError, from_dict, read_toml, run_command, to_dict,
                                   validate)
from pith_lit.train.optim import optimizer_states
from pith_lit.train.trainer import PEAK_FLOPS, meta_model, optimizer_for

# %% [markdown]
# ## The layouts of N GPUs
#
# `layouts` yields every config that differs from the given one in its parallel sizes, micro-batch, recomputation
# and (at pp = 1 with ep > 1) the overlapped schedule, for exactly `gpus` GPUs, that the config's own validation
# accepts.

# %%
#| export
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: Config, gpus: int, gpus_per_node: int = 8, micro_batches=(1, 2, 4, 8),
            recompute=("none", "attention", "layer")):
    "Every valid variant of `cfg` on `gpus` GPUs (parallel sizes, micro-batch, recompute, overlap)."
    cp = cfg.parallel.cp
    if gpus % cp:
        raise ConfigError(f"--gpus {gpus} is not divisible by the config's parallel.cp = {cp}")
    for pp in _divisors(gpus // cp):
        for ep in _divisors(gpus // cp // pp):
            for dpr in _divisors(gpus // cp // pp // ep):
                dp = gpus // cp // pp // ep // dpr
                if dpr > 1 and dp * cp * ep < gpus_per_node:
                    continue
                for mb in micro_batches:
                    for overlap in ((False, True) if pp == 1 and ep > 1 else (False,)):
                        for rec in recompute:
                            sets = [f"parallel.pp={pp}", f"parallel.dp_replicate={dpr}", f"parallel.dp={dp}",
                                    f"parallel.ep={ep}", f"train.micro_batch={mb}", f"train.recompute={rec}",
                                    f"parallel.overlap={str(overlap).lower()}", "parallel.pp_stage_layers=[]"]
                            try:
                                yield validate(from_dict(to_dict(cfg), sets), world_size=gpus)
                            except ConfigError:
                                continue

# %% [markdown]
# ## One layout's prediction
#
# `predict` estimates one config: memory always (engine/37), time when a profile is given (engine/38; then a
# pipelined layout first gets its cut). `cache` keeps what does not depend on the batch (each pipeline rank's FSDP units) between layouts.

# %%
#| export
def predict(cfg: Config, profile: Profile | None = None, link: Link = Link(),
            cache: dict | None = None) -> tuple[Estimate, StepTime | None]:
    "The planner's estimate of `cfg`'s layout (engine/37), and its step time when `profile` is given (engine/38)."
    cache = {} if cache is None else cache
    if profile is not None and cfg.parallel.pp > 1 and not cfg.parallel.pp_stage_layers:
        w = cfg.workload()
        key = ("cut", w.pp)   # one cut per pipeline size: the head against the layers decides it
        if key not in cache:
            cache[key] = choose_stage_layers(cfg.model, w, profile)
        cfg = validate(from_dict(to_dict(cfg), [f"parallel.pp_stage_layers={cache[key]}"]))
    w = cfg.workload()
    e = estimate(cfg.model, meta_model(cfg), w, optimizer_states(cfg.train.optimizer), cache)
    return e, (step_time(cfg.model, w, profile, e.units[0], link) if profile is not None else None)


def flops_per_token(cfg: Config) -> float:
    "The model's training FLOPs per token at the config's sequence length (models' `flops_per_token`)."
    return meta_model(cfg)().flops_per_token(cfg.train.seq_len)


def row(cfg: Config, e: Estimate, time: StepTime | None, gpu: float, flops: float, peak_flops: float) -> dict:
    "One line of the table: the layout, the predicted peak and what it needs, the step time and MFU if known."
    p, t = cfg.parallel, cfg.train
    out = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp": p.dp, "cp": p.cp, "ep": p.ep, "overlap": p.overlap,
           "micro_batch": t.micro_batch, "recompute": t.recompute,
           "stages": list(e.workload.stage_layers) or "even",
           "peak_gib": round(e.peak.gib(), 2), "needs_gib": round(e.needs() / GiB, 1), "fits": e.fits(gpu),
           "where": e.peak.where, "parts_gib": {k: round(v / GiB, 2) for k, v in e.peak.parts.items()}}
    if time is not None:
        out.update(tokens_per_s=round(time.tokens_per_s), step_s=round(time.seconds, 4),
                   mfu=round(time.tokens_per_s * flops / (peak_flops * cfg.world_size), 4),
                   time_parts_s={k: round(v, 4) for k, v in time.parts.items()})
    return out

# %% [markdown]
# A check on the CPU: the tiny default config on 4 GPUs of 4 GiB. Every layout the enumeration yields has 4 ranks
# and passes the config's own validation; all fit, and in each layout recomputing the layers needs no more memory
# than recomputing nothing. (A larger micro-batch need not need more: at a fixed global batch it means fewer
# micro-batches, and with one the gradients do not exist yet while the first forward runs.)

# %%
from pith_lit.train.config import load_config

tiny = load_config(overrides=["run.device=cpu", "train.global_batch=16"])
found = list(layouts(tiny, 4))
print(len(found), "layouts of 4 GPUs; for example", [c.layout for c in found[:3]])
cache = {}
estimates = [predict(c, cache=cache)[0] for c in found]
rows = [row(c, e, None, 4 * GiB, 1.0, 1.0) for c, e in zip(found, estimates)]
assert rows and all(r["fits"] for r in rows) and all(c.world_size == 4 for c in found)
by = {(r["pp"], r["dp"], r["ep"], r["overlap"], r["micro_batch"], r["recompute"]): e.peak.total
      for r, e in zip(rows, estimates)}
for (pp, dp, ep, ov, mb, rec), peak in by.items():
    assert rec != "none" or by.get((pp, dp, ep, ov, mb, "layer"), 0) <= peak
best = min(rows, key=lambda r: r["peak_gib"])
print({k: best[k] for k in ("pp", "dp", "ep", "micro_batch", "recompute", "peak_gib")})

# %% [markdown]
# The optimizer in the step time, on the CPU: the tiny default profiled with AdamW and with Muon (train/43, whose
# Newton–Schulz iterations run on each stacked expert tensor). Muon's step over a layer's experts takes longer than
# AdamW's, and, with the layers' times of one profile, the step with Muon is longer than the step with AdamW by the
# difference of the two optimizers' measured times over every part of the model (added by hand here: on one rank
# every part steps whole).

# %%
from dataclasses import replace

from pith_lit.engine.steptime import layer_kind
from pith_lit.models.protocol import LocalDispatcher

runs, profiles = {}, {}
for kind in ("adamw", "muon"):
    runs[kind] = load_config(overrides=["run.device=cpu", "train.seq_len=32", "train.micro_batch=2",
                                        f"train.optimizer={kind}"])
    profiles[kind] = profile_layers(meta_model(runs[kind])(), runs[kind].workload(), "cpu",
                                    LocalDispatcher(runs[kind].model.routed_experts), optimizer_for(runs[kind]), reps=5)
a, m = profiles["adamw"].optimizer_ms, profiles["muon"].optimizer_ms
print("optimizer ms, AdamW:", {k: round(v, 3) for k, v in a.items()}, "Muon:", {k: round(v, 3) for k, v in m.items()})
assert m["moe full experts"] > a["moe full experts"]
same_layers = replace(profiles["adamw"], optimizer="muon", optimizer_ms=m)
times = {kind: step_time(runs[kind].model, runs[kind].workload(), prof, predict(runs[kind])[0].units[0])
         for kind, prof in (("adamw", profiles["adamw"]), ("muon", same_layers))}
c = runs["adamw"].model
parts = ["root"] + [layer_kind(c, i) + x for i in range(c.num_hidden_layers) for x in ("", " experts")
                    if x == "" or c.is_moe_layer(i)]
by_hand = sum(m[p] - a[p] for p in parts) / 1e3
print(f"step with Muon {times['muon'].seconds * 1e3:.2f} ms, with AdamW {times['adamw'].seconds * 1e3:.2f} ms, "
      f"optimizers' difference {by_hand * 1e3:.2f} ms")
assert by_hand > 0 and abs(times["muon"].seconds - times["adamw"].seconds - by_hand) < 1e-9

# %% [markdown]
# ## The command line

# %%
#| export
def _table(rows: list[dict], timed: bool) -> str:
    head = "   pp  dpr   dp   cp   ep  ovl   mb  recompute   peak GiB  needs GiB" + (
        "   tokens/s    MFU  stages" if timed else "  stages")
    lines = [head]
    for r in rows:
        line = (f"{r['pp']:5d}{r['dp_replicate']:5d}{r['dp']:5d}{r['cp']:5d}{r['ep']:5d}{'yes' if r['overlap'] else '':>5}"
                f"{r['micro_batch']:5d}  {r['recompute']:9s}{r['peak_gib']:11.2f}{r['needs_gib']:11.1f}")
        if timed:
            line += f"{r['tokens_per_s']:11,d}{r['mfu']:7.1%}"
        lines.append(line + f"  {r['stages']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pith_lit.plan",
                                 description="Predict per-GPU peak memory and step time of layouts (engine/37, 38).")
    ap.add_argument("config", help="TOML run config")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    ap.add_argument("--gpus", type=int, help="list the layouts of this many GPUs (default: the config's own layout)")
    ap.add_argument("--gpu-memory", type=float, metavar="GiB",
                    help="memory of one GPU (default: this machine's GPU, else 140, an H200)")
    ap.add_argument("--profile", metavar="FILE", help="measured layer times (from --measure) for step times")
    ap.add_argument("--measure", metavar="FILE", help="time the model's layers on this machine's GPU into FILE")
    ap.add_argument("--link-node", type=float, default=200, metavar="GB/s", help="GPU-to-GPU bandwidth in a node")
    ap.add_argument("--link-network", type=float, default=40, metavar="GB/s", help="per-GPU bandwidth between nodes")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--top", type=int, default=15, help="rows shown (the fastest, or the smallest, first)")
    ap.add_argument("--all", action="store_true", help="also show layouts predicted not to fit")
    ap.add_argument("--check", action="store_true", help="print the config's own estimate as one JSON line")
    ap.add_argument("--debug", action="store_true", help="show the whole traceback of an error")
    return ap


def _gpu_memory(args) -> float:
    if args.gpu_memory is not None:
        return args.gpu_memory * GiB
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 140 * GiB


def _profile(args, cfg: Config) -> Profile | None:
    if args.measure:
        from pith_lit.models.protocol import LocalDispatcher
        if not torch.cuda.is_available():
            raise UserError("--measure times the layers on a GPU, and torch sees none here; measure on the GPU "
                            "machine, then pass the file with --profile")
        prof = profile_layers(meta_model(cfg)(), cfg.workload(), "cuda", LocalDispatcher(cfg.model.routed_experts),
                              optimizer_for(cfg))
        with open(args.measure, "w") as fh:
            json.dump(asdict(prof), fh, indent=1)
        print(f"wrote {args.measure}")
        return prof
    if args.profile:
        try:
            with open(args.profile) as fh:
                prof = Profile(**json.load(fh))
        except (OSError, ValueError, TypeError) as e:
            raise UserError(f"--profile {args.profile}: not a profile written by --measure ({e})") from None
        if (prof.optimizer, prof.fp8) != (cfg.train.optimizer, cfg.train.fp8):
            raise UserError(f"--profile {args.profile} timed train.optimizer = {prof.optimizer} with train.fp8 = "
                            f"{str(prof.fp8).lower()}; this run has {cfg.train.optimizer} and "
                            f"{str(cfg.train.fp8).lower()}: measure its profile with --measure")
        return prof
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def run():
        cfg = validate(from_dict(read_toml(args.config), args.set))
        gpu, link = _gpu_memory(args), Link(args.link_node * 1e9, args.link_network * 1e9, args.gpus_per_node)
        prof = _profile(args, cfg)
        flops = flops_per_token(cfg)
        peak = PEAK_FLOPS["H200"]
        if args.check or not args.gpus:
            e, t = predict(cfg, prof, link)
            r = row(cfg, e, t, gpu, flops, peak)
            if args.check:
                print(json.dumps(r))
                return
            print(f"{cfg.layout_text} (pp × dp_replicate × dp × cp × ep), micro-batch {cfg.train.micro_batch} × "
                  f"{cfg.num_micro_batches}: {e.summary()}; needs {e.needs() / GiB:.1f} of {gpu / GiB:.0f} GiB: "
                  f"{'fits' if e.fits(gpu) else 'does not fit'}")
            for rank, p in enumerate(e.peaks):
                print(f"  pipeline rank {rank}: {p.gib():.1f} GiB at the {p.where}")
            if t is not None:
                print(f"  predicted step {t.seconds:.3f} s, {t.tokens_per_s:,.0f} tokens/s, MFU "
                      f"{r['mfu']:.1%} ({', '.join(f'{k} {v:.3f} s' for k, v in t.parts.items())})")
            return
        cache, rows, fitted = {}, [], set()
        for c in layouts(cfg, args.gpus, args.gpus_per_node):
            key = (tuple(c.layout.values()), c.parallel.overlap, c.train.micro_batch)
            if c.train.recompute != "none" and key in fitted:
                continue   # recomputation costs time: only where the layout does not fit without it
            rows.append(row(c, *predict(c, prof, link, cache), gpu, flops, peak))
            if rows[-1]["fits"]:
                fitted.add(key)
        fit = [r for r in rows if r["fits"]]
        shown = rows if args.all else fit
        key = (lambda r: -r["tokens_per_s"]) if prof else (lambda r: r["needs_gib"])
        print(f"{len(rows)} layouts of {args.gpus} GPUs, {len(fit)} predicted to fit {gpu / GiB:.0f} GiB "
              f"(peak × {1.1:.1f} + 1 GiB); MFU against {peak / 1e12:.0f} TFLOP/s")
        if shown:
            print(_table(sorted(shown, key=key)[:args.top], prof is not None))
        if not fit:
            print("none fits: add GPUs, or shorten train.seq_len")
    return run_command(run, argv)


if __name__ == "__main__" and __spec__ is not None:
    raise SystemExit(main())

# %% [markdown]
# Run on the tiny default: its own layout, then the layouts of two GPUs, then a layout that cannot be (three GPUs at
# cp 2), which is one line on standard error and exit status 2:

# %%
from pith_lit.testing import repo_path

tiny_toml = str(repo_path("configs/tiny.toml"))
assert main([tiny_toml, "--set", "run.device=cpu"]) == 0
assert main([tiny_toml, "--set", "run.device=cpu", "--gpus", "2", "--gpu-memory", "2"]) == 0
assert main([tiny_toml, "--gpus", "3", "--set", "parallel.cp=2", "--set", "run.device=cpu"]) == 2
