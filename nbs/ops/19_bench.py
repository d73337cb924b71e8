# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Operator benchmarks
#
# Every kernel notebook ends with a `bench()` that times its kernels at the real models' sizes against the
# eager code they replace and reports the fraction of the machine's ceiling (about 4.3 TB/s device copy, read
# plus written; about 789 TFLOP/s bf16 matmul, both measured on the H200). This module runs them all in one
# process and prints one table, so a change to any kernel is measured the same way:
#
#     python -m pith_lit.ops.bench --json benchmarks/ops.json
#
# Each `bench()` returns a plain dict, `{"<kernel> <pass> <measure>": number}`. The table has one row per
# entry, grouped by module; `--json` writes the same rows with the GPU, the software versions and the date,
# ready to be summarised in `benchmarks/RESULTS.md`. It needs a GPU: on a CPU it says so and exits 2.

# %%
#| default_exp ops.bench

# %%
#| export
import argparse
import datetime
import json
import sys

import torch
import triton

from pith_lit.ops import attention, cross_entropy, grouped_linear, permute, swiglu

# %% [markdown]
# ## Rows and the table
#
# The module list is written out: adding a kernel notebook means adding its `bench` here.

# %%
#| export
BENCHES = {"swiglu": swiglu.bench, "permute": permute.bench, "grouped_linear": grouped_linear.bench,
           "attention": attention.bench,
           "cross_entropy": cross_entropy.bench}


def rows_of(module: str, results: dict) -> list[dict]:
    "One row per measured number of one module's `bench()`."
    return [{"module": module, "measure": measure, "value": float(value)} for measure, value in results.items()]


def table(rows: list[dict]) -> str:
    "The rows as one aligned text table, in the order given."
    width = max([len("measure")] + [len(r["measure"]) for r in rows])
    lines = [f"{'module':16s} {'measure':{width}s} {'value':>12s}", "-" * (30 + width)]
    lines += [f"{r['module']:16s} {r['measure']:{width}s} {r['value']:12.3f}" for r in rows]
    return "\n".join(lines)

# %% [markdown]
# Check the formatting on made-up numbers (the real ones need a GPU):

# %%
fake = rows_of("permute", {"gather fwd ms": 0.3125, "gather fwd % of copy": 78.04}) + \
       rows_of("grouped_linear", {"grouped_linear 768->2048 fwd+bwd TFLOP/s": 612.0})
print(table(fake))
lines = table(fake).splitlines()
assert len(lines) == 5 and lines[2].split() == ["permute", "gather", "fwd", "ms", "0.312"]
assert lines[4].endswith(" 612.000") and len({len(l) for l in lines[2:]}) == 1

# %% [markdown]
# ## The command

# %%
#| export
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pith_lit.ops.bench",
                                     description="Time every pith_lit kernel against eager PyTorch and the ceilings.")
    parser.add_argument("--json", metavar="PATH", help="also write the rows, GPU and versions to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pith_lit.ops.bench measures GPU kernels and needs a CUDA GPU; none is visible here "
              "(torch.cuda.is_available() is False). Run it on the GPU machine.", file=sys.stderr)
        sys.exit(2)
    rows = []
    for module, bench in BENCHES.items():
        rows += rows_of(module, bench())
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; ceilings: copy {permute.COPY_CEILING / 1e12:.1f} TB/s, "
          f"bf16 matmul {grouped_linear.MATMUL_CEILING / 1e12:.0f} TFLOP/s")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": gpu,
                       "torch": torch.__version__, "triton": triton.__version__, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__" and __spec__ is not None:
    main()

# %% [markdown]
# On this machine without a GPU the command must refuse with exit status 2:

# %%
if not torch.cuda.is_available():
    try:
        main([])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("main() ran without a GPU")

# %%
#| cuda
main([])
