import sys, torch, statistics
sys.path.insert(0, ".")
from triton.testing import do_bench
import pith_lit.ops.swiglu as sw
N, I = 131072, 768
x = torch.randn(N, 2 * I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(N, I, device="cuda", dtype=torch.bfloat16)
f = lambda: torch.autograd.grad(sw.swiglu(x), x, dy)
for wu, rep in [(25, 100)] * 6 + [(200, 500)] * 4:
    t = do_bench(f, warmup=wu, rep=rep, return_mode="all")
    t.sort()
    print(wu, rep, len(t), "min %.3f med %.3f p90 %.3f max %.3f" % (t[0], statistics.median(t), t[int(0.9*len(t))], t[-1]), flush=True)
