"""A corpus of real text that does not repeat within a benchmark run: the Python sources of the installed packages.

The embedded corpus (the standard library's source, 2 MB) is small: 300 steps of the Qwen3 bench (4 × 4096 tokens
a step, byte tokenizer) pass over it 2.5 times, and a model that memorises its text makes run-to-run differences
grow into percents of the loss. This writes one JSON line per `.py` file found under the folders that hold the
given packages (in a fixed shuffled order, files of at most 1 MB, until `--mb` megabytes), to be tokenized with
`python -m pith_lit.tokenize OUT.jsonl --out CORPUS --tokenizer bytes` and trained on with `data.corpus=CORPUS`.
The text depends on the packages installed, so a run that uses it names the machine it ran on.

    python3 benchmarks/code_corpus.py /tmp/code.jsonl --mb 40
"""
import argparse
import importlib
import json
import os
import random


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the .jsonl file to write")
    p.add_argument("--mb", type=float, default=40.0, help="stop after this many megabytes of text")
    p.add_argument("--packages", default="torch,triton,transformers,numpy,sympy",
                   help="comma-separated packages whose folders' .py files are read (missing ones are skipped)")
    a = p.parse_args()
    roots = []
    for name in a.packages.split(","):
        try:
            roots.append(os.path.dirname(importlib.import_module(name).__file__))
        except ImportError:
            continue
    if not roots:
        raise SystemExit(f"none of the packages {a.packages} is installed; name others with --packages")
    files = sorted(os.path.join(d, f) for r in roots for d, _, fs in os.walk(r) for f in fs if f.endswith(".py"))
    random.Random(0).shuffle(files)   # mixed packages, so the held-out tail reads like the rest
    limit, total, docs = int(a.mb * 2**20), 0, 0
    with open(a.out, "w") as out:
        for path in files:
            if total >= limit or os.path.getsize(path) > 2**20:
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text.strip():
                out.write(json.dumps({"text": text}) + "\n")
                total += len(text.encode())
                docs += 1
    print(f"{a.out}: {docs} files, {total / 2**20:.1f} MB from {', '.join(roots)}")


if __name__ == "__main__":
    main()
