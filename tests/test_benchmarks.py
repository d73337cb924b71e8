"""The measurement tools under benchmarks/ on the CPU: anatomy.py's reading of a step's trace, and fp8_rows.py's
and fp8_bench.py's parts at toy sizes (their figures need a GPU; what they call in the package does not)."""
import json
import subprocess
import sys

from conftest import ROOT, subprocess_env

sys.path.insert(0, str(ROOT))
from benchmarks.anatomy import anatomy  # noqa: E402

KERNELS = [("_fp8_gemm_kernel", 100), ("_fp8_wgrad_kernel", 60), ("_quant_weight_rows_kernel", 50),
           ("_quant_rows_kernel", 20), ("_expert_max_kernel", 1), ("_adamw_kernel", 10),
           ("cutlass::device_kernel<GemmUniversal<GroupProblemShape>>", 30), ("nvjet_sm90_tst_256", 40)]


def test_anatomy_sorts_fp8_kernels_into_their_own_classes(tmp_path):
    "FP8 GEMMs and quantization passes get classes of their own; with train.fp8 the GEMM classes carry no limit."
    events, t = [], 0
    for name, dur in KERNELS:
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur})
        t += dur + 5                                    # a 5 µs gap after each kernel: host idle
    (tmp_path / "trace-rank0.json").write_text(json.dumps({"traceEvents": events}))
    config = (ROOT / "configs" / "tiny.toml").read_text()
    for fp8 in (False, True):
        (tmp_path / "config.toml").write_text(config.replace("[train]\n", f"[train]\nfp8 = {str(fp8).lower()}\n", 1))
        got = anatomy(tmp_path)["classes"]
        ms = {c: round(o["ms"] * 1e3) for c, o in got.items()}   # µs
        assert ms["FP8 GEMMs"] == 160 and ms["FP8 quantization"] == 71 and ms["grouped GEMMs"] == 30
        assert ms["dense GEMMs"] == 40 and ms["optimizer"] == 10 and ms["host idle"] == 5 * (len(KERNELS) - 1)
        assert ms["norms and element-wise"] == 0
        assert ("limit_ms" in got["dense GEMMs"]) is not fp8 and ("limit_ms" in got["grouped GEMMs"]) is not fp8
        assert "limit_ms" in got["optimizer"]


SMOKE = r'''
import time, torch
import benchmarks.fp8_bench as fb
import benchmarks.fp8_rows as fr
fb.DEV = fr.DEV = "cpu"                                  # toy sizes on the CPU, Triton's kernels interpreted
for name in ("empty_cache", "synchronize", "reset_peak_memory_stats"):
    setattr(torch.cuda, name, lambda *a: None)
torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a: 0
fr.do_bench = fb.do_bench = lambda fn, return_mode="median": (lambda t: (fn(), time.perf_counter() - t)[1] * 1e3)(
    time.perf_counter())
shape, tokens = dict(hidden=256, ffn=128, experts=4, top_k=2), 64
fr.bench_dense("tiny", dict(hidden=256, outs=[256, 128, 128], o_in=256), tokens)
for part in ("gemms", "mlp", "quant", "wgrad", "rowsweep"):
    getattr(fr, f"bench_{part}")("tiny", shape, tokens)
fr.WEIGHT_SWEEP = fr.WEIGHT_SWEEP[:2]
fr.bench_weights("tiny", {"gate_up": (2, 96, 256), "o": (1, 64, 384)})
fb.SWEEP = fb.SWEEP[:2]                                  # fp8_bench.py's parts but its dense one (F.scaled_mm, GPU only)
fb.bench_experts("tiny", shape, tokens, True)
fb.bench_mlp("tiny", shape, tokens)
fb.bench_quant_sweep("tiny", shape, tokens, warps=(4,))
failed = [(r["group"], r["case"], r["note"]) for r in fb.ROWS if "FAILED" in r["note"] or "DIFFERS" in r["note"]]
assert not failed, failed
whole = [r for r in fb.ROWS if "whole rows" in r["case"]]   # the sweeps' settings against the package's, bit for bit
assert len(whole) >= 8 and all(r["note"] == "same" for r in whole), whole
from pith_lit.ops import fp8
settings = (fp8.ROWS_BM, fp8.WEIGHT_ROWS, fp8.WEIGHT_ROWS_GIVEN, fp8.QUANT_WARPS, fp8.WEIGHT_ROW_TILE,
            fp8.WEIGHT_ROW_TILE_WARPS, fp8.ROWS_WHOLE)
assert settings == (32, 64, 128, 8, 16384, 4, 8192), f"a sweep left its setting changed: {settings}"
print("cases", len(fb.ROWS))
'''


def test_fp8_benchmarks_run_their_parts_at_toy_sizes():
    """benchmarks/fp8_rows.py and fp8_bench.py need a GPU for their figures, but their plumbing (the package functions
    they call, their arguments and results) runs on the CPU under the interpreter: every part but those that only a
    GPU has (the profiler's, F.scaled_mm's), no case failing."""
    proc = subprocess.run([sys.executable, "-c", SMOKE], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert int(proc.stdout.split("cases")[-1]) > 100, proc.stdout[-2000:]
