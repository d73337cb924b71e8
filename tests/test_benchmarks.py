"""The measurement tools under benchmarks/ that run off the GPU: anatomy.py's reading of a step's trace."""
import json
import sys

from conftest import ROOT

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
