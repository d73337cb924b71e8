"""The FP8 row quantizers' GPU variants compile for sm90 (an H100 or H200) on a CPU-only machine.

The interpreter runs a kernel as Python and accepts code that Triton's compiler refuses: a name that a `constexpr`
branch binds to a tile of one shape and a later loop re-binds to another fails only when compiled. So each variant
that the package or benchmarks/fp8_rows.py launches is compiled here, all the way to a cubin (Triton ships ptxas), in
a child process without TRITON_INTERPRET. Whether a variant is fast is for the GPU to say
(`benchmarks/fp8_rows.py --parts weights,rowsweep`).
"""
import subprocess
import sys

import pytest

from conftest import subprocess_env

COMPILE = r'''
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pith_lit.ops import fp8

sm90 = GPUTarget("cuda", 90, 32)


def build(kernel, types, constexprs, warps):
    sig = dict(types, **{name: "constexpr" for name in constexprs})
    c = triton.compile(ASTSource(kernel, sig, constexprs=constexprs), target=sm90, options={"num_warps": warps})
    assert "cubin" in c.asm, list(c.asm)
    return c


weights = {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "s_ptr": "*fp32", "N": "i32", "K": "i32",
           "s_e": "i32", "s_n": "i32", "s_k": "i32"}
cases = [dict(FWD=True, TRANS=False, BN=16384 // kp2, GIVEN=False, KP2=kp2) for kp2 in (1024, 4096, 8192, 16384)]
cases += [dict(FWD=f, TRANS=t, BN=64, GIVEN=False, KP2=0) for f, t in [(True, False), (False, True), (True, True)]]
cases += [dict(FWD=False, TRANS=True, BN=128, GIVEN=True, KP2=0)]                  # the backward's, scales given
for ce in cases:
    c = build(fp8._quant_weight_rows_kernel, weights, ce, 8)
    print("weights", ce)

rows = {"x_ptr": "*bf16", "dh_ptr": "*bf16", "mult_ptr": "*fp32", "rmult_ptr": "*fp32", "q_ptr": "*fp8e4nv",
        "s_ptr": "*fp32", "qt_ptr": "*fp8e4nv", "amax_ptr": "*fp32", "row_offs_ptr": "*i32", "tile_offs_ptr": "*i32",
        "M": "i32", "K": "i32", "E": "i32", "LDT": "i32"}
passes = [dict(MULT=False, RMULT=False, AMAX=False, ROWS=True, TRANS=True, ACT=0),    # the input, with its transpose
          dict(MULT=False, RMULT=False, AMAX=False, ROWS=True, TRANS=True, ACT=1),    # SwiGLU's output
          dict(MULT=True, RMULT=True, AMAX=True, ROWS=True, TRANS=False, ACT=0),      # dY ⊙ s_W, column maxima
          dict(MULT=True, RMULT=True, AMAX=True, ROWS=True, TRANS=False, ACT=2),      # SwiGLU's gradient
          dict(MULT=False, RMULT=False, AMAX=False, ROWS=False, TRANS=True, ACT=0)]   # the transpose alone
for p, (kp2, warps) in itertools.product(passes, [(0, 4), (2048, 4), (4096, 8), (8192, 8)]):
    sb = 1 if kp2 == 0 else min(32, 8192 // kp2)
    c = build(fp8._quant_rows_kernel, rows, dict(p, E_P2=128, BM=32, SB=sb, KP2=kp2), warps)
    print("rows", p, kp2, warps)
print("compiled")
'''


def test_row_quantizers_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = subprocess_env()
    env.pop("TRITON_INTERPRET")
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
