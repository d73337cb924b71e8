"""Gated delta rule: forward and forward+backward time of pith_lit's Triton kernels (ops/16_gated_delta_rule)
against transformers' torch chunked implementation and, when `import fla` works, FlashLinearAttention's
`chunk_gated_delta_rule`, at Qwen3.5-35B-A3B's linear-attention shapes (16 key heads, 32 value heads, head dims
128, bf16), plus the max error of each against the float32 torch chunked form on the same bf16 inputs.
Run on one GPU from the repository root:
    PYTHONPATH=. OUT=/tmp python3 benchmarks/gdr_bench.py
It prints one line per measurement and writes $OUT/gdr_bench.json. A case that fails prints its error and the
others still run."""
import inspect
import json
import os
import traceback

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from pith_lit.ops.gated_delta_rule import chunk_gated_delta_rule, chunk_gated_delta_rule_torch

OUT = os.environ.get("OUT", "/tmp")
SHAPES = {  # name: (B, T, Hk, Hv, D, document lengths per row or None)
    "qwen3.5 B1 T4096": (1, 4096, 16, 32, 128, None),
    "qwen3.5 B2 T4096": (2, 4096, 16, 32, 128, None),
    "qwen3.5 B1 T16384": (1, 16384, 16, 32, 128, None),
    "qwen3.5 B2 T4096 docs": (2, 4096, 16, 32, 128, [1000, 1, 2000, 1095]),
}
ERR_T = 1024  # errors are measured at this length (the float32 reference is slow and memory-hungry)

try:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule as _hf
    HF_CHUNK = inspect.unwrap(_hf)  # the torch path, even where transformers would route to an installed fla
except Exception as e:  # noqa: BLE001 - the benchmark reports what it cannot run and goes on
    HF_CHUNK = None
    print("transformers' torch_chunk_gated_delta_rule unavailable:", e)
try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as FLA_CHUNK
except Exception as e:  # noqa: BLE001
    FLA_CHUNK = None
    print("fla unavailable:", type(e).__name__, e)


def inputs(B, T, Hk, Hv, D, lens, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    q, k, v = (r(B, T, h, D).bfloat16().requires_grad_() for h in (Hk, Hk, Hv))
    gl = (-F.softplus(r(B, T, Hv) * 2 - 1)).requires_grad_()
    beta = torch.sigmoid(r(B, T, Hv) * 2).bfloat16().requires_grad_()
    docs = None
    if lens is not None:
        lens = [n * T // sum(lens) for n in lens[:-1]]
        lens.append(T - sum(lens))
        docs = torch.repeat_interleave(torch.arange(len(lens), device="cuda"),
                                       torch.tensor(lens, device="cuda")).int().expand(B, T).contiguous()
    return q, k, v, gl, beta, docs


def runners(docs, Hk, Hv):
    "name -> fn(q, k, v, g, beta) -> o, for the implementations that apply to this case."
    out = {"pith_lit": lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, docs=docs)[0]}
    if HF_CHUNK is not None and docs is None:  # transformers' torch path ignores document boundaries
        rep = lambda x: x.repeat_interleave(Hv // Hk, 2)     # it takes as many key heads as value heads
        out["transformers torch"] = lambda q, k, v, g, b: HF_CHUNK(rep(q), rep(k), v, g, b,
                                                                   use_qk_l2norm_in_kernel=True)[0]
    if FLA_CHUNK is not None:
        def fla(q, k, v, g, b):
            rep = lambda x: x.repeat_interleave(Hv // Hk, 2)  # fla may not take fewer key than value heads
            if docs is None:
                return FLA_CHUNK(rep(q), rep(k), v, g, b, use_qk_l2norm_in_kernel=True)[0]
            B, T = docs.shape  # varlen: one row of B·T tokens and cu_seqlens
            starts = torch.ones_like(docs, dtype=torch.bool)
            starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
            cu = torch.cat([starts.flatten().nonzero().flatten(),
                            torch.tensor([B * T], device="cuda")]).to(torch.int32)
            flat = lambda x: x.reshape(1, B * T, *x.shape[2:])
            o = FLA_CHUNK(flat(rep(q)), flat(rep(k)), flat(v), flat(g), flat(b), cu_seqlens=cu,
                          use_qk_l2norm_in_kernel=True)[0]
            return o.view(B, T, *o.shape[2:])
        out["fla"] = fla
    return out


def main():
    res = {}
    for name, (B, T, Hk, Hv, D, lens) in SHAPES.items():
        q, k, v, g, beta, docs = inputs(B, T, Hk, Hv, D, lens)
        leaves = [q, k, v, g, beta]
        do = torch.randn(B, T, Hv, D, device="cuda", dtype=torch.bfloat16)
        qe, ke, ve, ge, be, de = inputs(B, ERR_T, Hk, Hv, D, lens, seed=1)
        le = [qe, ke, ve, ge, be]
        dref = torch.randn(B, ERR_T, Hv, D, device="cuda")
        ref32 = [t.detach().float().requires_grad_() for t in le]
        o_r = chunk_gated_delta_rule_torch(*ref32, docs=de)[0]
        want = torch.autograd.grad((o_r * dref).sum(), ref32)
        for who, fn in runners(docs, Hk, Hv).items():
            key = f"{name} {who}"
            try:
                fwd = do_bench(lambda: fn(q, k, v, g, beta), return_mode="median")
                both = do_bench(lambda: torch.autograd.grad(fn(q, k, v, g, beta), leaves, do), return_mode="median")
                res[f"{key} fwd ms"], res[f"{key} fwd+bwd ms"] = fwd, both
                print(f"{key:45s} fwd {fwd:8.3f} ms   fwd+bwd {both:8.3f} ms", flush=True)
                fn_e = runners(de, Hk, Hv)[who]
                o = fn_e(qe, ke, ve, ge, be)
                got = torch.autograd.grad((o.float() * dref).sum(), le)
                err = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()
                errs = {"o": err(o, o_r), **{n: err(a, b) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"),
                                                                             got, want)}}
                for n, e in errs.items():
                    res[f"{key} max err {n}"] = e
                print(f"{key:45s} max err (T={ERR_T}) " + " ".join(f"{n} {e:.1e}" for n, e in errs.items()),
                      flush=True)
            except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                res[f"{key} error"] = f"{type(e).__name__}: {e}"
                print(f"{key:45s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                traceback.print_exc()
            torch.cuda.empty_cache()
        for who in ("transformers torch", "fla"):
            if f"{name} {who} fwd+bwd ms" in res and f"{name} pith_lit fwd+bwd ms" in res:
                res[f"{name} speed-up vs {who}"] = res[f"{name} {who} fwd+bwd ms"] / res[f"{name} pith_lit fwd+bwd ms"]
                print(f"{name:45s} fwd+bwd speed-up vs {who}: {res[f'{name} speed-up vs {who}']:.2f}x")
        del q, k, v, g, beta, docs, leaves, do, qe, ke, ve, ge, be, le, ref32, o_r, want
        torch.cuda.empty_cache()
    res["device"] = torch.cuda.get_device_name()
    res["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    with open(f"{OUT}/gdr_bench.json", "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", f"{OUT}/gdr_bench.json")


if __name__ == "__main__":
    main()
