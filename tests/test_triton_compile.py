"""The FP8 row quantizers' GPU variants compile for sm90 (an H100 or H200) on a CPU-only machine.

The interpreter runs a kernel as Python and accepts code that Triton's compiler refuses: a name that a `constexpr`
branch binds to a tile of one shape and a later loop re-binds to another fails only when compiled. So each variant
that the package or benchmarks/fp8_rows.py launches is compiled here, all the way to a cubin (Triton ships ptxas), in
a child process without TRITON_INTERPRET. Whether a variant is fast is for the GPU to say
(`benchmarks/fp8_rows.py --parts weights,rowsweep`); `--parts resources` reports the registers and spills of each, also
without a GPU.
"""
import subprocess
import sys

import pytest

from conftest import subprocess_env

COMPILE = r'''
import itertools
import re
from benchmarks.fp8_rows import ROW_ARGS, ROW_PASSES, WEIGHT_ARGS, compile_sm90, resources
from pith_lit.ops import fp8


def build(kernel, types, constexprs, warps):
    c = compile_sm90(kernel, types, constexprs, warps)
    assert "cubin" in c.asm, list(c.asm)


cases = [dict(FWD=True, TRANS=False, BN=16384 // kp2, GIVEN=False, KP2=kp2) for kp2 in (1024, 4096, 8192, 16384)]
cases += [dict(FWD=f, TRANS=t, BN=64, GIVEN=False, KP2=0) for f, t in [(True, False), (False, True), (True, True)]]
cases += [dict(FWD=False, TRANS=True, BN=128, GIVEN=True, KP2=0)]                  # the backward's, scales given
for ce in cases:
    build(fp8._quant_weight_rows_kernel, WEIGHT_ARGS, ce, 8)
    print("weights", ce)

for (name, (p, _)), (kp2, warps) in itertools.product(ROW_PASSES.items(), [(0, 4), (2048, 4), (4096, 8), (8192, 8)]):
    if kp2 and p["TRANS"]:                     # a pass writing the transpose always takes the two loops
        continue
    build(fp8._quant_rows_kernel, ROW_ARGS, dict(p, E_P2=128, BM=32, KP2=kp2), warps)
    print("rows", name, kp2, warps)
used = resources(fp8._quant_weight_rows_kernel, WEIGHT_ARGS, cases[-1], 8)   # what `--parts resources` reads
regs, stack, shared = map(int, re.fullmatch(r"(\d+) registers, (\d+) B stack, (\d+) B shared", used).groups())
assert 16 <= regs <= 255 and stack >= 0 and shared >= 0, used
print("compiled")
'''


def test_row_quantizers_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = subprocess_env()
    env.pop("TRITON_INTERPRET")
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
