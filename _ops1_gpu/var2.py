import sys, torch, statistics
sys.path.insert(0, ".")
from triton.testing import do_bench, do_bench_cudagraph
import pith_lit.ops.swiglu as sw
N, I = 131072, 768
x = torch.randn(N, 2 * I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(N, I, device="cuda", dtype=torch.bfloat16)
for name, fn in [("fast", sw.swiglu), ("eager", sw.swiglu_ref)]:
    f = lambda: torch.autograd.grad(fn(x), x, dy)
    for k in range(3):
        t = do_bench(lambda: [f() for _ in range(10)], warmup=100, rep=300, return_mode="all")
        print(name, "loop10", len(t), "min %.3f med %.3f max %.3f" % (min(t)/10, statistics.median(t)/10, max(t)/10), flush=True)
    for k in range(2):
        t = do_bench(f, warmup=100, rep=300, return_mode="median")
        print(name, "plain med %.3f" % t, flush=True)
    try:
        for k in range(2):
            print(name, "cudagraph %.3f" % do_bench_cudagraph(f, rep=300), flush=True)
    except Exception as e:
        print("cudagraph failed", repr(e)[:300])
import time
f = lambda: torch.autograd.grad(sw.swiglu(x), x, dy)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(200): f()
t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
print("host enqueue per iter %.3f ms, total per iter %.3f ms" % ((t1-t0)/200*1e3, (t2-t0)/200*1e3))
