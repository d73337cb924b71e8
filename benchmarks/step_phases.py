"""The phases of a training step on one GPU, timed with a synchronize around each: forward+backward (with the
gradient reduction inside it), clipping, the optimizer; then a profile of one step (the top operators by CUDA and
by CPU time). The Qwen3 bench compiled at micro-batch 4, global batch 4; extra arguments are config overrides.

usage: PYTHONPATH=. python3 benchmarks/step_phases.py NAME [KEY=VALUE ...]"""
import sys, time, json, torch
from pith_lit.train.config import load_config
import pith_lit.train.trainer as T
over = ["run.dir=/tmp/prof_" + sys.argv[1], "train.compile=true", "train.micro_batch=4", "train.global_batch=4",
        "log.tensorboard=false", "ckpt.every=-1", "train.steps=30"] + sys.argv[2:]
cfg = load_config("configs/bench-qwen3-30b-a3b.toml", over)
run = T.build_run(cfg)
timing = {}
def timed(name, fn):
    def w(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter(); r = fn(*a, **k); torch.cuda.synchronize()
        timing[name] = timing.get(name, 0) + time.perf_counter() - t
        return r
    return w
for name in ("_forward_backward", "reduce_gradients", "grad_norm"):
    if hasattr(T, name):
        setattr(T, name, timed(name, getattr(T, name)))
run.optimizer.step = timed("optimizer.step", run.optimizer.step)
for s in range(8):
    if s == 4:
        timing.clear()
    torch.cuda.synchronize(); t = time.perf_counter()
    T.train_step(run, s)
    torch.cuda.synchronize(); timing["step"] = timing.get("step", 0) + time.perf_counter() - t
print(sys.argv[1], json.dumps({k: round(v / 4 * 1000, 1) for k, v in timing.items()}), flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    T.train_step(run, 8); torch.cuda.synchronize()
ka = prof.key_averages()
print(ka.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
print(ka.table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60))
