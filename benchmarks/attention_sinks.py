"""GPT-OSS attention with learned sinks, both ways, in one run: ops/14's `flash_attention` against the SDPA path the
model had before it (`models.gpt_oss.sink_attention`: the sink as an extra key, a boolean mask, one
`F.scaled_dot_product_attention` call, which SDPA sends to its masked kernel). GPT-OSS-20B's shape: batch 2 × 4096
tokens, 64 query heads and 8 key/value heads of 64, full causal layers and 128-token sliding-window layers, bf16,
`q, k, v` as transposed `(B, S, H, D)` projections; forward and forward+backward, `triton.testing.do_bench` medians.
Run on a GPU from the repository root:

    PYTHONPATH=. python3 benchmarks/attention_sinks.py

It also prints the largest difference of the two outputs over the largest output (both bf16)."""
import torch
from triton.testing import do_bench

from pith_lit.models.gpt_oss import sink_attention
from pith_lit.ops.attention import flash_attention

from ops import attention_inputs  # benchmarks/ops.py, beside this script

B, S, HQ, HKV, D = 2, 4096, 64, 8, 64
print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}")
for window in (None, 128):
    q, k, v, s = attention_inputs(B, S, HQ, HKV, D, D, True)
    dout = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
    calls = {"flash_attention (ops/14)": lambda: flash_attention(q, k, v, s, window=window)[0],
             "sink_attention (SDPA, masked)": lambda: sink_attention(q, k, v, s, window)}
    times = {}
    for name, fn in calls.items():
        fwd = do_bench(fn, return_mode="median")
        both = do_bench(lambda: torch.autograd.grad(fn(), (q, k, v, s), dout), return_mode="median")
        times[name] = both
        print(f"window {str(window):5s} {name:32s} fwd {fwd:7.3f} ms  fwd+bwd {both:7.3f} ms")
    a, b = (fn().float() for fn in calls.values())
    ours, sdpa = times.values()
    print(f"window {str(window):5s} speed-up (fwd+bwd) {sdpa / ours:.2f}x  "
          f"max |difference| / max |output| {((a - b).abs().max() / b.abs().max()).item():.1e}")
