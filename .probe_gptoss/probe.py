import warnings; warnings.filterwarnings("ignore")
import contextlib, torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from triton.testing import do_bench
from pith_lit.models.gpt_oss import sink_attention, sink_attention_reference
dt = torch.bfloat16
B, nq, nkv, S, d = 2, 64, 8, 4096, 64
q = torch.randn(B, nq, S, d, device="cuda", dtype=dt, requires_grad=True)
k, v = (torch.randn(B, nkv, S, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
sinks = torch.randn(nq, device="cuda", dtype=dt, requires_grad=True)
g = torch.randn(B, nq, S, d, device="cuda", dtype=dt)
flops = 4 * B * nq * S * S * d / 2
def report(name, f, ins):
    ms_f = do_bench(f, return_mode="median"); ms_fb = do_bench(lambda: torch.autograd.grad(f(), ins, g), return_mode="median")
    print(f"{name:40s} fwd {ms_f:7.2f} ms ({flops/ms_f/1e9:6.1f} causal TFLOP/s) fwd+bwd {ms_fb:7.2f} ms ({3.5*flops/ms_fb/1e9:6.1f})", flush=True)
report("flash causal, no sink", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v))
for be in (None, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
    for w in (128, None):
        try:
            with sdpa_kernel([be]) if be else contextlib.nullcontext():
                report(f"sink_attention {be} w={w}", lambda: sink_attention(q, k, v, sinks, w), (q, k, v, sinks))
        except Exception as e: print(be, "FAILS", str(e)[:120])
report("explicit reference w=128", lambda: sink_attention_reference(q, k, v, sinks, 128), (q, k, v, sinks))
with torch.no_grad():
    ref = sink_attention_reference(q[:1, :8].float(), k[:1, :1].float(), v[:1, :1].float(), sinks[:8].float(), 128)
    out = sink_attention(q[:1, :8], k[:1, :1], v[:1, :1], sinks[:8], 128).float()
    print("bf16 sink_attention vs fp32 reference, rel err", ((out - ref).norm() / ref.norm()).item())
