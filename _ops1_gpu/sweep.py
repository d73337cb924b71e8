"""Temporary GPU sweep for ops 10/13 (helper ops1); not part of the project."""
import sys, time
import torch, triton
sys.path.insert(0, ".")
from triton.testing import do_bench
import pith_lit.ops.swiglu as sw
import pith_lit.ops.cross_entropy as ce
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
t0 = time.time()
# 0. addmm with out_dtype into an fp32 accumulator
a = torch.randn(640, 320, device="cuda", dtype=torch.bfloat16); b = torch.randn(320, 160, device="cuda", dtype=torch.bfloat16)
c = torch.randn(640, 160, device="cuda"); ref = c + a.float() @ b.float()
torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
print("addmm out_dtype rel err", ((c - ref).norm() / ref.norm()).item(), flush=True)
# copy ceiling
z = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
ms = do_bench(lambda: z.clone(), return_mode="median"); print(f"copy {2*z.numel()*2/ms/1e6:.0f} GB/s", flush=True)
del z
# 1. swiglu tiles
N, I = 131072, 768
x = torch.randn(N, 2 * I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(N, I, device="cuda", dtype=torch.bfloat16)
nb = N * I * 2
orig = sw._tiles
for cfg in [(16, 256, 8), (16, 256, 8), (16, 256, 4), (8, 256, 4), (32, 256, 8), (4, 256, 4), (2, 256, 2), (32, 128, 4), (64, 128, 8), (8, 512, 8), (4, 1024, 8), (8, 1024, 16)]:
    sw._tiles = lambda n, cfg=cfg: cfg
    row = []
    for fn in (sw.swiglu, sw.clamped_swiglu):
        with torch.no_grad():
            f = do_bench(lambda: fn(x), return_mode="median")
        y = fn(x)
        bw = do_bench(lambda: torch.autograd.grad(y, x, dy, retain_graph=True), return_mode="median")
        row += [3 * nb / f / 1e6, 5 * nb / bw / 1e6]
    print(cfg, "swiglu fwd/bwd GB/s %.0f %.0f  clamped fwd/bwd %.0f %.0f" % tuple(row), flush=True)
del x, dy, y
sw._tiles = orig
r = sw.bench(); print({k: round(v, 3) for k, v in r.items() if 'fwd ' in k or 'fwd+bwd' in k}, flush=True)
print("t", time.time() - t0, flush=True)
# 2. CE row kernel
V = 151936; R = 4096
logits = torch.randn(R, V, device="cuda", dtype=torch.bfloat16)
labels = torch.randint(0, V, (R,), device="cuda"); loss = torch.empty(R, device="cuda")
for blk in [4096, 8192]:
    for w in [8, 16]:
        if blk // (32 * w) < 1: continue
        ms = do_bench(lambda: ce._ce_rows_kernel[(R,)](logits, labels, loss, V, V, -100, BLOCK=blk, num_warps=w), return_mode="median")
        print(f"ce rows BLOCK={blk} warps={w}: {ms:.3f} ms  {3*R*V*2/ms/1e6:.0f} GB/s (3 passes)", flush=True)
del logits
print("t", time.time() - t0, flush=True)
