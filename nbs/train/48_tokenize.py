# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # `python -m pith_lit.tokenize`: your own text as packed tokens
#
# ```
# python -m pith_lit.tokenize INPUT... --out PATH [--tokenizer bytes|stdlib-bpe-N|tokenizer.json] [--field text]
# python -m pith_lit.tokenize --train-tokenizer VOCAB [--out PATH]
# ```
#
# turns text files into the packed format of notebook 41 (`PATH.bin`, `PATH.idx`, `PATH.json`), which
# `--set data.corpus=PATH` then trains on. Tokenizing a large corpus takes hours, so the command is
# **resumable**: after each input file it records how far it got, and a re-run of the same command after a
# kill, a crash or a bad input continues from there instead of starting over. The header, which marks the
# output as usable, is written only at the very end.
#
# The second form trains a byte-level BPE of VOCAB ids on the embedded corpus (notebook 41) and writes its
# `tokenizer.json`, for use with any Hugging Face tool or as `--tokenizer PATH` here.

# %%
#| default_exp tokenize

# %%
#| export
import argparse
import json
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from pith_lit.train.config import ExistingFile, InvalidInput, MissingFile, run_command
from pith_lit.train.data import (
    PackedWriter, TokenWindows, load_tokenizer, open_packed, packed_base, stdlib_corpus, stdlib_packed, train_bpe,
    write_json_atomic)

# %%
import shutil

import numpy as np

# %% [markdown]
# ## Inputs
#
# An input is a `.txt` file (one document), a `.jsonl` file (one document per line, its text in the field
# `text` or the one `--field` names) or a folder, which stands for every `.txt` and `.jsonl` file under it in
# sorted order. Inputs keep the order given, so the same command always produces the same bytes.

# %%
#| export
SUFFIXES = (".txt", ".jsonl")


def input_files(inputs) -> list[Path]:
    "Expand the command line's inputs into the list of files to read, in order."
    files = []
    for spec in map(Path, inputs):
        if spec.is_dir():
            files += sorted(p for p in spec.rglob("*") if p.suffix in SUFFIXES and not p.is_dir())
        elif not spec.exists():
            raise MissingFile(f"input {spec} does not exist")
        elif spec.suffix in SUFFIXES:
            files.append(spec)
        else:
            raise InvalidInput(f"input {spec}: expected a .txt file, a .jsonl file or a folder of them")
    if not files:
        raise InvalidInput(f"no .txt or .jsonl files in the inputs {[str(i) for i in inputs]}")
    return files


def read_documents(path: Path, field: str = "text"):
    "The documents of one input file: the whole of a .txt, each non-blank line's `field` of a .jsonl."
    with open(path, encoding="utf-8") as f:
        try:
            if path.suffix == ".txt":
                yield f.read()
                return
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InvalidInput(f"{path}:{lineno} is not valid JSON ({e})") from e
                if not isinstance(doc, dict) or not isinstance(doc.get(field), str):
                    raise InvalidInput(f"{path}:{lineno} has no string field {field!r}; choose the field with --field")
                yield doc[field]
        except UnicodeDecodeError as e:
            raise InvalidInput(f"{path} is not UTF-8 text ({e})") from e

# %%
scratch = Path(tempfile.mkdtemp())
(scratch / "in" / "more").mkdir(parents=True)
(scratch / "in" / "a.txt").write_text("The first document.\nIt has two lines.\n")
(scratch / "in" / "more" / "b.jsonl").write_text(
    "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["second", "third ∑", ""])) + "\n\n")
(scratch / "in" / "notes.md").write_text("not an input")
(scratch / "c.txt").write_text("last")
files = input_files([scratch / "in", scratch / "c.txt"])
assert [f.relative_to(scratch).as_posix() for f in files] == ["in/a.txt", "in/more/b.jsonl", "c.txt"]
docs = [d for f in files for d in read_documents(f)]
assert docs == ["The first document.\nIt has two lines.\n", "second", "third ∑", "", "last"]

# %% [markdown]
# ## The resumable loop
#
# The output's files are written in this order:
#
# 1. `PATH.bin` and `PATH.idx` grow as documents are added;
# 2. after each input file, both are flushed to disk and `PATH.progress.json` is replaced (atomically) by a record of
#    the file list, how many of its files are done, and the token and document counts at that point;
# 3. at the end, `PATH.json` (the header) is written atomically and the progress file removed.
#
# A re-run that finds a progress file checks that it describes the same files, tokenizer and field, truncates the
# data files to the recorded counts (dropping whatever the interrupted run wrote after its last record), and
# continues with the next file. A reader accepts only a corpus with a header, so a half-written output is never
# taken for a finished one. A re-run that finds the header has nothing to do.

# %%
#| export
def tokenize_files(inputs, out, tokenizer_spec: str = "bytes", field: str = "text") -> dict:
    "Tokenize `inputs` into the packed corpus `out`, resuming an interrupted run of the same inputs. The header."
    files, tokenizer, base = input_files(inputs), load_tokenizer(tokenizer_spec), packed_base(out)
    names = [str(f) for f in files]
    source = dict(inputs=[str(i) for i in inputs], field=field, files=len(files),
                  bytes=sum(f.stat().st_size for f in files))
    progress_path = base.with_suffix(".progress.json")
    if base.with_suffix(".json").exists():
        header = open_packed(base).header
        if (header["tokenizer_fingerprint"], header["source"]) != (tokenizer.fingerprint, source):
            raise InvalidInput(f"{base}.json already holds a finished corpus made from other inputs or another "
                             f"tokenizer; choose another --out, or delete {base}.json, .bin and .idx")
        progress_path.unlink(missing_ok=True)   # left over if a run stopped between the header and its removal
        print(f"{base} is already complete: {header['num_tokens']:,} tokens in {header['num_docs']:,} documents")
        return header
    record = dict(files=names, field=field, tokenizer=tokenizer.fingerprint, done=0, num_tokens=0, num_docs=0)
    if progress_path.exists():
        try:
            saved = json.loads(progress_path.read_text())
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{progress_path} is not valid JSON ({e}); delete it to start over") from e
        if {k: saved.get(k) for k in ("files", "field", "tokenizer")} != \
                {k: record[k] for k in ("files", "field", "tokenizer")}:
            raise InvalidInput(f"{progress_path} records an interrupted run with other input files, field or "
                             f"tokenizer; re-run that command to finish it, or delete {progress_path} to start over")
        record = saved
        print(f"resuming {base} after {record['done']} of {len(files)} files ({record['num_tokens']:,} tokens)")
    writer = PackedWriter(base, tokenizer, source, record["num_tokens"], record["num_docs"])
    bar = tqdm(total=len(files), initial=record["done"], unit="file", desc=f"tokenizing into {base.name}")
    for i in range(record["done"], len(files)):
        text = 0
        for doc in read_documents(files[i], field):
            text += len(doc)
            writer.add(tokenizer.encode(doc))
        if not text:
            tqdm.write(f"warning: {files[i]} holds no text")
        writer.flush()
        record.update(done=i + 1, num_tokens=writer.num_tokens, num_docs=writer.num_docs)
        write_json_atomic(progress_path, record)
        bar.update()
        bar.set_postfix(tokens=f"{writer.num_tokens:,}")
    bar.close()
    if writer.num_tokens == writer.num_docs:   # nothing but the end-of-document tokens
        for suffix in (".bin", ".idx", ".progress.json"):
            base.with_suffix(suffix).unlink(missing_ok=True)
        raise InvalidInput(f"the inputs {[str(i) for i in inputs]} hold no text (field {field!r}): nothing to "
                           "tokenize; check the paths, or --field for .jsonl files")
    header = writer.finish()
    progress_path.unlink()
    return header

# %% [markdown]
# Tokenize the sample inputs and compare every document in the output with an independent encoding: the
# document's UTF-8 bytes plus the byte tokenizer's `eos` (257).

# %%
out = scratch / "out" / "sample"
header = tokenize_files([scratch / "in", scratch / "c.txt"], out)
pk = open_packed(out)
assert header["num_docs"] == len(docs) and pk.tokens.dtype == np.uint16
for i, d in enumerate(docs):
    assert pk.doc(i).tolist() == list(d.encode("utf-8")) + [257]
assert not out.with_suffix(".progress.json").exists()
assert tokenize_files([scratch / "in", scratch / "c.txt"], out) == header    # a re-run has nothing to do

# %% [markdown]
# **Resuming.** A bad line in the middle of a `.jsonl` stops the run after the first file is recorded and part of
# the second has been written. After fixing the file, the same command resumes, and the result is identical,
# byte for byte, to the run above. (tests/test_data.py does the same with a process killed by a signal.)

# %%
good = (scratch / "in" / "more" / "b.jsonl").read_text()
(scratch / "in" / "more" / "b.jsonl").write_text(good.replace('"id": 2}', '"id": 2'))   # break the third line
again = scratch / "out" / "again"
try:
    tokenize_files([scratch / "in", scratch / "c.txt"], again)
    raise AssertionError("a bad line was accepted")
except ValueError as e:
    print(e)
assert not again.with_suffix(".json").exists()
print("recorded:", {k: v for k, v in json.loads(again.with_suffix(".progress.json").read_text()).items()
                    if k != "files"})
(scratch / "in" / "more" / "b.jsonl").write_text(good)
tokenize_files([scratch / "in", scratch / "c.txt"], again)
for suffix in (".bin", ".idx"):
    assert again.with_suffix(suffix).read_bytes() == out.with_suffix(suffix).read_bytes()
assert json.loads(again.with_suffix(".json").read_text()) == header

# %% [markdown]
# ## A summary of a corpus
#
# Until the trainer exists, `--summary` shows what training would read: the embedded corpus's files, bytes,
# tokens and windows at `seq_len` 128, and the start of one window decoded back to text.

# %%
#| export
def summarize(corpus: str = "stdlib", tokenizer: str = "bytes", cache_dir=None, seq_len: int = 128) -> None:
    "Print the size of a corpus ('stdlib' or a packed path) and a decoded sample window."
    tok = load_tokenizer(tokenizer)
    cache_dir = Path(tempfile.gettempdir()) / "pith_lit" if cache_dir is None else cache_dir
    base = stdlib_packed(tok, cache_dir) if corpus == "stdlib" else packed_base(corpus)
    data = open_packed(base)
    if data.header["tokenizer_fingerprint"] != tok.fingerprint:
        raise InvalidInput(f"{base} was tokenized with {data.header['tokenizer']!r}, not {tokenizer!r}")
    h, src = data.header, data.header["source"]
    windows = TokenWindows(data.tokens, seq_len, seed=0)
    print(f"corpus {corpus} ({base}): {src['files']:,} files, {src['bytes']:,} bytes, "
          f"{h['num_docs']:,} documents, {h['num_tokens']:,} tokens ({h['dtype']}, tokenizer {h['tokenizer']}, "
          f"vocabulary {h['vocab_size']}), {len(windows):,} windows of seq_len {seq_len}")
    x, _ = windows.batch(0, 0, 1, 1)
    print("a window, decoded:\n" + tok.decode(x[0].tolist()))

# %%
summarize(str(out), seq_len=16)

# %% [markdown]
# ## Training a tokenizer
#
# `train_tokenizer` trains the BPE of notebook 41 on the embedded corpus and writes it to a path of your choice
# (an existing file is refused, not overwritten). The check loads the file with transformers'
# `PreTrainedTokenizerFast`, an independent reader of the format, and compares its ids with ours.

# %%
#| export
def train_tokenizer(vocab_size: int, out="tokenizer.json") -> Path:
    "Train a byte-level BPE of `vocab_size` ids on the embedded corpus and write its tokenizer.json to `out`."
    out = Path(out)
    if vocab_size < 257:
        raise InvalidInput(f"--train-tokenizer {vocab_size}: a byte-level BPE needs at least 257 ids (256 bytes and "
                           "the end-of-document token)")
    if out.exists():
        raise ExistingFile(f"{out} already exists; choose another --out or delete it")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    paths, texts = stdlib_corpus()
    bpe = train_bpe(texts, vocab_size)
    tmp = out.with_name(out.name + ".tmp")
    bpe.save(str(tmp))
    tmp.replace(out)
    print(f"wrote {out}: a byte-level BPE of {bpe.get_vocab_size()} ids trained on {len(paths)} files of the "
          f"embedded corpus in {time.perf_counter() - t0:.1f} s; use it with --set data.tokenizer={out}")
    return out

# %%
import transformers

path = train_tokenizer(1024, scratch / "trained" / "tokenizer.json")
fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
mine = load_tokenizer(str(path))
sample = "naïve → ∑\n    def main(argv=None) -> int:\n        return 0\n"
assert fast(sample, add_special_tokens=False)["input_ids"] == mine.encode(sample)
assert fast.decode(mine.encode(sample)) == sample and len(fast) == mine.vocab_size == 1024
assert fast.convert_tokens_to_ids("<|endoftext|>") == mine.eos_id
try:
    train_tokenizer(1024, path)
    raise AssertionError("an existing file was overwritten")
except FileExistsError as e:
    print(e)

# %% [markdown]
# ## The command line

# %%
#| export
def main(argv=None) -> int:
    "The command line; returns the exit status (2 with one line for an input the user can fix)."
    p = argparse.ArgumentParser(prog="python -m pith_lit.tokenize", description=(
        "Tokenize text into a packed corpus (PATH.bin, PATH.idx, PATH.json) for data.corpus=PATH. "
        "Re-running an interrupted command resumes it."))
    p.add_argument("inputs", nargs="*", help=".txt files (one document each), .jsonl files (one document per "
                   "line) or folders of them")
    p.add_argument("--out", metavar="PATH", help="output path without extension")
    p.add_argument("--tokenizer", default="bytes", help="'bytes', 'stdlib-bpe-N' (a BPE of N ids trained on the "
                   "embedded corpus) or the path of a Hugging Face tokenizer.json")
    p.add_argument("--field", default="text", help="the field of a .jsonl line that holds its text")
    p.add_argument("--summary", action="store_true", help="print a summary of the embedded corpus and exit")
    p.add_argument("--train-tokenizer", type=int, metavar="VOCAB", help="train a byte-level BPE of VOCAB ids on the "
                   "embedded corpus and write its tokenizer.json to --out (default tokenizer.json)")
    p.add_argument("--debug", action="store_true", help="show the whole traceback of an error (also PITH_DEBUG=1)")
    args = p.parse_args(argv)
    if args.train_tokenizer is None and not args.summary and (not args.inputs or not args.out):
        p.error("give the INPUT files or folders and --out PATH (or --summary, or --train-tokenizer VOCAB)")

    def run():
        if args.train_tokenizer is not None:
            return train_tokenizer(args.train_tokenizer, args.out or "tokenizer.json")
        if args.summary:
            return summarize("stdlib", args.tokenizer)
        h = tokenize_files(args.inputs, args.out, args.tokenizer, args.field)
        print(f"wrote {args.out}: {h['num_tokens']:,} tokens in {h['num_docs']:,} documents ({h['dtype']})")
    return run_command(run, argv)

# %%
#| export
if __name__ == "__main__" and __spec__ is not None:
    raise SystemExit(main())

# %% [markdown]
# The same run through `main`, with a Hugging Face tokenizer this time (the tiny BPE of notebook 41 trained on the
# sample text): the dtype follows its vocabulary.

# %%
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.train_from_iterator(docs * 20, trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
bpe.save(str(scratch / "tokenizer.json"))
main([str(scratch / "in"), str(scratch / "c.txt"), "--out", str(scratch / "out" / "bpe"),
      "--tokenizer", str(scratch / "tokenizer.json")])
pk = open_packed(scratch / "out" / "bpe")
assert pk.tokens.dtype == np.uint16 and pk.header["vocab_size"] == bpe.get_vocab_size()
assert pk.doc(0).tolist() == bpe.encode(docs[0], add_special_tokens=False).ids + [bpe.token_to_id("<|endoftext|>")]

# %%
shutil.rmtree(scratch)
