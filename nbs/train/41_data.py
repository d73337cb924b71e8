# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Data: tokenizers, packed tokens, and batches you can resume from any step
#
# Pretraining data takes four steps here, each in one section below:
#
# 1. a **tokenizer** turns text into integer ids: a byte tokenizer, any Hugging Face `tokenizer.json`, or a BPE
#    trained here on the embedded corpus (the default), none of which needs a download;
# 2. an **embedded corpus**, the Python standard library's own source, so that training works offline;
# 3. a **packed file** holds a whole corpus as one flat array of token ids, read through a memory map, so a
#    corpus larger than RAM costs nothing to open;
# 4. **`TokenWindows`** cuts that array into fixed-length training windows and hands each data-parallel rank its
#    share of every step's global batch, as a pure function of the step number, so a resumed run needs no
#    replay.
#
# `python -m pith_lit.tokenize` (notebook 48) builds packed files from your own text with this module.

# %%
#| default_exp train.data

# %%
#| export
import hashlib
import json
import os
import platform
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from pith_lit.train.config import InvalidInput, MissingFile, stdlib_bpe_vocab

# %%
import time

# %% [markdown]
# ## Tokenizers
#
# A tokenizer here is anything with `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size` and `eos_id`
# (the id that ends a document). Two more attributes identify it in the headers of packed files: `spec`, the
# string it was loaded from, and `fingerprint`, which changes whenever the ids it produces could change.
#
# The byte tokenizer maps each UTF-8 byte to its value, 0–255, and adds three special tokens after them:
# `<bos>` = 256, `<eos>` = 257, `<pad>` = 258. Its vocabulary is therefore 259, and a model trained on it needs
# `vocab_size` ≥ 259. It knows every string without training, at the price of long sequences (one token per
# byte).

# %%
#| export
class ByteTokenizer:
    "UTF-8 bytes as ids 0..255, then `<bos>`=256, `<eos>`=257, `<pad>`=258."
    specials = ("<bos>", "<eos>", "<pad>")
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259
    spec = fingerprint = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        "Bytes decode as UTF-8 (an invalid sequence becomes U+FFFD); special ids print as their names."
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
            else:
                out += [run.decode("utf-8", errors="replace"), self.specials[i - 256]]
                run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")

# %%
bt = ByteTokenizer()
text = "naïve café ∑ → 🐍"
ids = bt.encode(text)
assert ids == list(text.encode("utf-8")) and max(ids) < 256
assert bt.decode(ids) == text
assert bt.decode(ids + [bt.eos_id] + bt.encode("next")) == text + "<eos>next"
print(len(text), "characters ->", len(ids), "byte tokens")

# %% [markdown]
# A Hugging Face tokenizer is read from a local `tokenizer.json` with the `tokenizers` library (no network).
# `tokenizer.json` does not say which of its special tokens ends a document (that lives in other files of a
# model repository), so we take the first of the usual names that the vocabulary contains, and say so when none
# is there. Encoding adds no special tokens of its own: the packer places the end-of-document token itself.
# The fingerprint is the SHA-256 of the file, so editing the tokenizer invalidates data made with it.

# %%
#| export
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<｜end▁of▁sentence｜>")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from a local tokenizer.json, behind the same small interface.
    `spec` is what it was asked for by (default: the path)."""
    def __init__(self, path, spec: str | None = None):
        path = Path(path)
        self.spec = str(path) if spec is None else spec
        self.fingerprint = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        self.tok = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        found = [self.tok.token_to_id(name) for name in EOS_NAMES if self.tok.token_to_id(name) is not None]
        if not found:
            raise InvalidInput(f"tokenizer {path} has none of the end-of-document tokens {list(EOS_NAMES)}; "
                             "add one of them as a special token")
        self.eos_id = found[0]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

# %% [markdown]
# To check the wrapper without a download, train a tiny byte-level BPE on some text, save it, load it back
# through `HFTokenizer`, and compare with the `tokenizers` object we trained.

# %%
scratch = Path(tempfile.mkdtemp())
sample_text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "encoder.py").read_text()
bpe = tokenizers.Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator([sample_text], trainers.BpeTrainer(
    vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
bpe.save(str(scratch / "tokenizer.json"))

hf = HFTokenizer(scratch / "tokenizer.json")
line = "def encode(self, o):  # naïve"
assert hf.encode(line) == bpe.encode(line).ids and hf.decode(hf.encode(line)) == line
assert hf.eos_id == bpe.token_to_id("<|endoftext|>") and hf.vocab_size == bpe.get_vocab_size()
print("BPE vocabulary", hf.vocab_size, "| eos id", hf.eos_id, "|", len(hf.encode(line)), "tokens for",
      len(bt.encode(line)), "bytes")

# %% [markdown]
# ## The embedded corpus: the standard library's source
#
# Every Python installation carries a few tens of MB of well-formed, varied text: its standard library. We use
# its `*.py` files, found from the running interpreter, sorted by path, and take files until `max_bytes` is
# reached. Third-party packages (`site-packages`) are left out, and so are the few files that are not UTF-8
# (test fixtures for other encodings), because a Hugging Face tokenizer needs text. The same Python version gives
# the same corpus on every machine; another version gives a slightly different one, which the cache key
# below notices.

# %%
#| export
STDLIB_BYTES = 4_000_000  # the default size of the embedded corpus: ~4M byte tokens


def stdlib_corpus(max_bytes: int = STDLIB_BYTES) -> tuple[list[Path], list[str]]:
    "The standard library's `*.py` files in sorted order, up to `max_bytes` in total: (paths, texts)."
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        found += [(Path(folder) / f).relative_to(root).as_posix() for f in files if f.endswith(".py")]
    paths, texts, total = [], [], 0
    for p in (root / name for name in sorted(found)):
        raw = p.read_bytes()
        if total + len(raw) > max_bytes:
            break
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:   # a file in another encoding: left out
            continue
        paths.append(p)
        total += len(raw)
    if not paths:
        raise MissingFile(f"no standard library sources under {root} (max_bytes={max_bytes}); this Python "
                                "ships without them: tokenize your own text with python -m pith_lit.tokenize")
    return paths, texts

# %%
t0 = time.perf_counter()
paths, texts = stdlib_corpus(200_000)
root = Path(sysconfig.get_paths()["stdlib"])
names = [p.relative_to(root).as_posix() for p in paths]
assert names == sorted(names) and stdlib_corpus(200_000)[0] == paths   # sorted and deterministic
nbytes = sum(len(t.encode()) for t in texts)
assert nbytes <= 200_000 and all("site-packages" not in n for n in names)
print(f"Python {platform.python_version()}: {len(paths)} files, {nbytes:,} bytes, first {names[:3]}, "
      f"last {names[-1]} ({time.perf_counter() - t0:.2f} s)")

# %% [markdown]
# ## A tokenizer trained on the embedded corpus
#
# Bytes are a poor default for an MoE: with 259 distinct ids the router sees 259 distinct embeddings at the
# first layer, much of its input is the same few letters, and routing collapses onto a few experts. A
# byte-level BPE trained on the corpus itself gives ids that look like a real model's (keywords, identifiers,
# indentation runs) and needs no download: `tokenizers` trains one of 4096 ids on the 4 MB corpus in about a
# second on two cores. It is the GPT-2 recipe: the text is split by GPT-2's pattern into words, each word's
# UTF-8 bytes are mapped to 256 printable characters (the `ByteLevel` alphabet, all in the initial vocabulary, so
# every string is encodable), and merges of the most frequent adjacent pairs are added until the vocabulary
# holds N ids. One special token, `<|endoftext|>`, ends each document. The result is an ordinary
# `tokenizer.json` that transformers' `PreTrainedTokenizerFast` loads.
#
# `data.tokenizer = "stdlib-bpe-N"` names it. `stdlib_bpe` trains it into `cache_dir` once: the folder's name is
# a hash of what determines the merges (the corpus's files and bytes, N, the `tokenizers` version), the file is
# written under a temporary name and renamed, and training is deterministic, so several ranks that build it at
# once write the same bytes. `python -m pith_lit.tokenize --train-tokenizer N` (notebook 48) writes one where you
# choose.

# %%
#| export
EOS_TOKEN = "<|endoftext|>"   # the end-of-document token of the tokenizers trained here (first of EOS_NAMES)


def train_bpe(texts, vocab_size: int) -> tokenizers.Tokenizer:
    "A byte-level BPE of at most `vocab_size` ids (the 256 byte symbols and `<|endoftext|>` among them) trained on `texts`."
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return bpe


def _source(paths, texts) -> dict:
    "What identifies the embedded corpus's content: Python version, file count, bytes, and a hash of names and texts."
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256()
    for p, t in zip(paths, texts):
        digest.update(p.relative_to(root).as_posix().encode() + b"\0" + t.encode() + b"\0")
    return dict(corpus="stdlib", python=platform.python_version(), files=len(paths),
                bytes=sum(len(t.encode()) for t in texts), sha256=digest.hexdigest())


def stdlib_bpe(vocab_size: int, cache_dir, max_bytes: int = STDLIB_BYTES) -> Path:
    "The tokenizer.json of a BPE of `vocab_size` ids trained on the embedded corpus, trained into `cache_dir` unless there."
    paths, texts = stdlib_corpus(max_bytes)
    key = json.dumps([vocab_size, tokenizers.__version__, _source(paths, texts)], sort_keys=True)
    path = Path(cache_dir) / f"stdlib-bpe-{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:16]}" / "tokenizer.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="tokenizer.json.")
        os.close(fd)
        train_bpe(texts, vocab_size).save(tmp)
        os.replace(tmp, path)
    return path

# %% [markdown]
# Train the default, 4096 ids, into the scratch folder and check it: a second call reuses the file; training
# again gives the same bytes (so concurrent ranks agree); the vocabulary has N ids with the byte alphabet and the
# end-of-document token in it; every document of the corpus round-trips through encode and decode; and the
# tokenizer is a real one, about 3.6 bytes per token instead of 1.

# %%
t0 = time.perf_counter()
bpe_path = stdlib_bpe(4096, scratch / "tok")
trained_s = time.perf_counter() - t0
stamp = bpe_path.stat().st_mtime_ns
assert stdlib_bpe(4096, scratch / "tok") == bpe_path and bpe_path.stat().st_mtime_ns == stamp
assert train_bpe(stdlib_corpus()[1], 4096).to_str() == tokenizers.Tokenizer.from_file(str(bpe_path)).to_str()
tok = HFTokenizer(bpe_path, spec="stdlib-bpe-4096")
assert tok.vocab_size == 4096 and tok.eos_id == tok.tok.token_to_id(EOS_TOKEN)
assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(tok.tok.get_vocab())
all_texts = stdlib_corpus()[1]
n_tokens = sum(len(ids) for ids in (tok.encode(t) for t in all_texts))
assert all(tok.decode(tok.encode(t)) == t for t in all_texts[::10]) and tok.decode(tok.encode(text)) == text
ratio = sum(len(t.encode()) for t in all_texts) / n_tokens
assert ratio > 3
print(f"trained in {trained_s:.1f} s: {n_tokens:,} tokens for the corpus, {ratio:.2f} bytes per token;",
      [tok.decode([i]) for i in tok.encode("    def __init__(self, path):")])

# %% [markdown]
# `load_tokenizer` turns a spec into a tokenizer: `bytes`, `stdlib-bpe-N` (trained into `cache_dir` when it is
# not there yet), or the path of a tokenizer.json.

# %%
#| export
def load_tokenizer(spec: str, cache_dir=None):
    """`'bytes'` for the byte tokenizer, `'stdlib-bpe-N'` for the BPE of N ids trained on the embedded corpus (kept
    in `cache_dir`, default a folder in the system's temporary directory), otherwise the path of a Hugging Face
    tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    n = stdlib_bpe_vocab(spec)
    if n is not None:
        cache_dir = Path(tempfile.gettempdir()) / "pith_lit" if cache_dir is None else cache_dir
        return HFTokenizer(stdlib_bpe(n, cache_dir), spec=spec)
    if not Path(spec).is_file():
        raise MissingFile(f"tokenizer {spec!r}: no such file; pass 'bytes' for the built-in byte tokenizer, "
                          "'stdlib-bpe-N' for a BPE of N ids trained on the embedded corpus, or the path of a Hugging "
                          "Face tokenizer.json")
    return HFTokenizer(spec)

# %%
assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
same = load_tokenizer("stdlib-bpe-4096", scratch / "tok")
assert same.fingerprint == tok.fingerprint and same.spec == "stdlib-bpe-4096"
assert load_tokenizer(str(scratch / "tokenizer.json")).encode(line) == hf.encode(line)

# %% [markdown]
# ## The packed format
#
# A packed corpus `NAME` is three files:
#
# - `NAME.bin`: every document's token ids followed by the end-of-document id, all documents back to back, as
#   raw little-endian integers of the smallest unsigned type that holds every id (`uint8` for a vocabulary of at
#   most 256, `uint16` up to 65536, `uint32` above);
# - `NAME.idx`: one `uint64` per document, the offset just past its last token (its `eos`), so document `i` is
#   `tokens[idx[i-1]:idx[i]]`;
# - `NAME.json`: the header: format version, dtype, vocabulary size, `eos` id, the tokenizer's spec and
#   fingerprint, the number of tokens and documents, and where the text came from.
#
# The header is written last, under a temporary name and then renamed, so its presence means the other two files
# are complete. Reading checks the file sizes against the header's counts (a truncated copy fails at open, not
# mid-run) and maps the arrays with `numpy.memmap`: the OS pages in only what is read.

# %%
#| export
FORMAT = "pith_lit packed tokens"
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    "The smallest unsigned integer type that holds ids 0..vocab_size-1."
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise InvalidInput(f"a vocabulary of {vocab_size} tokens does not fit uint32 (at most {2**32} ids); "
                     "use a smaller tokenizer")

# %%
assert [token_dtype(v).name for v in (2, 256, 257, 259, 65536, 65537, 151936, 2**32)] == \
    ["uint8", "uint8", "uint16", "uint16", "uint16", "uint32", "uint32", "uint32"]

# %% [markdown]
# `PackedWriter` appends documents. It can also reopen a partly written corpus at a known count of tokens and
# documents (truncating whatever an interrupted run wrote after that point), which is how
# `python -m pith_lit.tokenize` resumes. `flush` pushes everything to disk; `finish` writes the header.

# %%
#| export
def write_json_atomic(path: Path, obj) -> None:
    "Write JSON under a temporary name, then rename: a reader sees the old file or the new one, never half."
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


class PackedWriter:
    "Appends documents (each followed by `eos`) to `base`.bin/.idx; `finish()` writes `base`.json."
    def __init__(self, base, tokenizer, source: dict, num_tokens: int = 0, num_docs: int = 0):
        self.base, self.tokenizer, self.source = Path(base), tokenizer, source
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.num_tokens, self.num_docs = num_tokens, num_docs
        self.base.parent.mkdir(parents=True, exist_ok=True)
        self.bin = _open_at(self.base.with_suffix(".bin"), num_tokens * self.dtype.itemsize)
        self.idx = _open_at(self.base.with_suffix(".idx"), num_docs * 8)

    def add(self, ids) -> None:
        "Append one document's ids and the end-of-document id."
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.tokenizer.vocab_size):
            raise InvalidInput(f"token ids outside 0..{self.tokenizer.vocab_size - 1} from tokenizer "
                             f"{self.tokenizer.spec!r}; its vocab_size is wrong")
        doc = np.append(ids, self.tokenizer.eos_id).astype(self.dtype)
        self.bin.write(doc.tobytes())
        self.num_tokens += doc.size
        self.num_docs += 1
        self.idx.write(np.uint64(self.num_tokens).tobytes())

    def flush(self) -> None:
        "Everything added so far reaches the disk (survives a kill or a crash after this returns)."
        for f in (self.bin, self.idx):
            f.flush()
            os.fsync(f.fileno())

    def finish(self) -> dict:
        "Close the data files and write the header; the corpus is complete once this returns."
        if self.num_docs == 0:
            raise InvalidInput(f"no documents were added to {self.base}; check the inputs")
        self.flush()
        self.bin.close()
        self.idx.close()
        header = dict(format=FORMAT, version=FORMAT_VERSION, dtype=self.dtype.name,
                      vocab_size=self.tokenizer.vocab_size, eos_id=self.tokenizer.eos_id,
                      tokenizer=self.tokenizer.spec, tokenizer_fingerprint=self.tokenizer.fingerprint,
                      num_tokens=self.num_tokens, num_docs=self.num_docs, source=self.source)
        write_json_atomic(self.base.with_suffix(".json"), header)
        return header


def _open_at(path: Path, size: int):
    "Open `path` for appending after its first `size` bytes (a new file when size is 0)."
    if size == 0:
        return open(path, "wb")
    if not path.exists() or path.stat().st_size < size:
        raise InvalidInput(f"{path} is shorter than the {size} bytes recorded as written; it was changed "
                         "after the interrupted run: delete the output's files and start again")
    f = open(path, "r+b")
    f.truncate(size)
    f.seek(size)
    return f

# %% [markdown]
# Reading validates before it maps. Each way a file can be wrong gets its own message that says what to do.

# %%
#| export
@dataclass
class Packed:
    "A packed corpus opened for reading: the header and memory-mapped token ids and document ends."
    header: dict
    tokens: np.ndarray     # (num_tokens,) in the header's dtype
    doc_ends: np.ndarray   # (num_docs,) uint64

    def doc(self, i: int) -> np.ndarray:
        "The token ids of document i, ending with eos."
        return self.tokens[int(self.doc_ends[i - 1]) if i else 0:int(self.doc_ends[i])]


HEADER_KEYS = ("format", "version", "dtype", "vocab_size", "eos_id", "tokenizer", "tokenizer_fingerprint",
               "num_tokens", "num_docs", "source")


def packed_base(path) -> Path:
    "`NAME`, `NAME.bin`, `NAME.idx` or `NAME.json` all name the corpus `NAME`."
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".bin", ".idx", ".json") else path


def open_packed(path) -> Packed:
    "Open a packed corpus after checking its header and file sizes."
    base = packed_base(path)
    hpath = base.with_suffix(".json")
    remake = f"re-create it with: python -m pith_lit.tokenize INPUT... --out {base}"
    if not hpath.exists():
        if base.with_suffix(".progress.json").exists():
            raise MissingFile(f"packed corpus {base} is incomplete: its tokenizing was interrupted "
                                    f"({base}.progress.json exists); re-run the same python -m pith_lit.tokenize "
                                    "command to finish it")
        raise MissingFile(f"no packed corpus at {base}: {hpath} does not exist; {remake}")
    try:
        header = json.loads(hpath.read_text())
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{hpath} is not valid JSON ({e}): the header is corrupt; {remake}") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise InvalidInput(f"{hpath} is not a pith_lit packed-token header; {remake}")
    missing = [k for k in HEADER_KEYS if k not in header]
    if missing:
        raise InvalidInput(f"{hpath} lacks the fields {missing}; {remake}")
    if header["version"] != FORMAT_VERSION:
        raise InvalidInput(f"{hpath} has format version {header['version']}, this code reads version "
                         f"{FORMAT_VERSION}; {remake}")
    vocab, need = header["vocab_size"], token_dtype(header["vocab_size"])
    if header["dtype"] != need.name:
        raise InvalidInput(f"{hpath}: a vocabulary of {vocab} tokens needs dtype {need.name} (ids up to {vocab - 1}), "
                         f"but the header says {header['dtype']}: the header is corrupt; {remake}")
    n, d = header["num_tokens"], header["num_docs"]
    if n < 1 or d < 1:
        raise InvalidInput(f"{hpath} records {n} tokens in {d} documents: the corpus is empty; {remake}")
    for suffix, size in ((".bin", n * need.itemsize), (".idx", d * 8)):
        f = base.with_suffix(suffix)
        if not f.exists():
            raise MissingFile(f"{f} is missing (its header {hpath} exists); {remake}")
        if f.stat().st_size != size:
            raise InvalidInput(f"{f} has {f.stat().st_size} bytes but its header records {size}: the file is "
                             f"truncated or corrupt; {remake}")
    return Packed(header, np.memmap(base.with_suffix(".bin"), dtype=need, mode="r", shape=(n,)),
                  np.memmap(base.with_suffix(".idx"), dtype=np.uint64, mode="r", shape=(d,)))

# %% [markdown]
# Round trip: pack a few documents, open the result, and compare every document with the tokenizer's own
# encoding of its text plus `eos`.

# %%
docs = ["first document", "", "späť → ∂", "x" * 1000]
w = PackedWriter(scratch / "demo", bt, source={"demo": True})
for d in docs:
    w.add(bt.encode(d))
header = w.finish()
pk = open_packed(scratch / "demo.bin")
assert pk.tokens.dtype == np.uint16 and header["num_tokens"] == sum(len(d.encode()) + 1 for d in docs)
for i, d in enumerate(docs):
    assert pk.doc(i).tolist() == bt.encode(d) + [bt.eos_id]
    assert bt.decode(pk.doc(i)) == d + "<eos>"
assert (scratch / "demo.bin").stat().st_size == 2 * header["num_tokens"]
print({k: header[k] for k in ("dtype", "vocab_size", "num_tokens", "num_docs")})

# %% [markdown]
# A truncated copy is refused at open (tests/test_data.py checks every error message):

# %%
import shutil

shutil.copy(scratch / "demo.json", scratch / "cut.json")
shutil.copy(scratch / "demo.idx", scratch / "cut.idx")
(scratch / "cut.bin").write_bytes((scratch / "demo.bin").read_bytes()[:-10])
try:
    open_packed(scratch / "cut")
    raise AssertionError("a truncated corpus was accepted")
except ValueError as e:
    assert "truncated or corrupt" in str(e)
    print(e)

# %% [markdown]
# **The model's vocabulary.** Token ids index the model's embedding, so every id in the data must be below the
# model's `vocab_size`: the rule is *data vocab_size ≤ model vocab_size*. A larger model vocabulary is allowed
# (rows that no token uses are never trained, as when the byte tokenizer's 259 ids run in a model with
# Qwen3's 151936); a smaller one is an error.

# %%
#| export
def check_vocab(data_vocab: int, model_vocab: int, where) -> None:
    "Data vocab_size must be ≤ the model's vocab_size (a token id indexes the embedding)."
    if data_vocab > model_vocab:
        raise InvalidInput(f"the data at {where} uses a vocabulary of {data_vocab} tokens but the model's vocab_size "
                         f"is {model_vocab}: every token id must index the embedding, so set the model's "
                         f"vocab_size to at least {data_vocab} (or use data from a smaller tokenizer)")

# %% [markdown]
# ## Windows, shuffling and sharding
#
# Training reads fixed-length **windows** of `seq_len + 1` tokens: the inputs are the first `seq_len`, the
# labels are the same window shifted by one (`labels[t]` is the token after `inputs[t]`). Window `i` starts at
# token `i * seq_len`, so consecutive windows share one boundary token: their inputs never overlap and every
# token after the first is a label exactly once. Windows run across document boundaries; the `eos` between two
# documents is an ordinary label, so the model learns to end a document. No window needs padding (the loss's
# ignore index, −100, is for other callers).
#
# **Order.** Each epoch visits every window once, in the order of a permutation drawn from a NumPy generator
# seeded with `(seed, epoch)`. Sample `p` of the run (counting across steps) is therefore window
# `perm[p // n][p % n]`, for `n` windows: a pure function of `p`.
#
# **Batches.** A step's global batch is `world × num_micro × micro_batch` consecutive samples. Rank `r` takes
# the `r`-th contiguous block of them and cuts it into its `num_micro` micro-batches. So ranks read disjoint
# windows, together they read exactly the global batch, and the result is the same as one rank reading it as
# `world × num_micro` micro-batches. `batch(step, ...)` needs nothing from earlier steps, so a run resumed at
# step `k` reads exactly what an uninterrupted one would.
#
# **Split.** A `windows` range selects a contiguous part of the corpus: the train/val split puts the last
# `val_frac` of the windows in validation.

# %%
#| export
class TokenWindows:
    "Fixed-length, shifted (inputs, labels) windows of a token array, shuffled per epoch, sharded by rank."
    def __init__(self, tokens, seq_len: int, seed: int, rank: int = 0, world: int = 1,
                 windows: range | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside 0..world-1 for world {world}")
        total = (len(tokens) - 1) // seq_len
        if total < 1:
            raise InvalidInput(f"the corpus has {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
                             f"{seq_len + 1}: use a shorter seq_len or more data")
        windows = range(total) if windows is None else windows
        if not (len(windows) and windows.step == 1 and 0 <= windows.start and windows.stop <= total):
            raise ValueError(f"windows {windows} must be a non-empty, contiguous part of range({total})")
        self.tokens, self.seq_len, self.seed, self.rank, self.world = tokens, seq_len, seed, rank, world
        self.windows = windows
        self._perm = (None, None)   # (epoch, permutation) of the last epoch used: a cache, not state

    def __len__(self) -> int:
        return len(self.windows)

    def permutation(self, epoch: int) -> np.ndarray:
        "Window order of one epoch, from a generator seeded with (seed, epoch)."
        if self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self)))
        return self._perm[1]

    def window_ids(self, step: int, micro_index: int, micro_batch: int, num_micro: int) -> np.ndarray:
        "Indices (into the corpus's windows) of this rank's micro-batch `micro_index` of step `step`."
        if step < 0 or micro_batch < 1 or not 0 <= micro_index < num_micro:
            raise ValueError(f"need step ≥ 0, micro_batch ≥ 1 and 0 ≤ micro_index < num_micro; got step={step}, "
                             f"micro_index={micro_index}, micro_batch={micro_batch}, num_micro={num_micro}")
        first = (step * self.world * num_micro + self.rank * num_micro + micro_index) * micro_batch
        n = len(self)
        return np.array([self.windows.start + self.permutation(p // n)[p % n]
                         for p in range(first, first + micro_batch)], dtype=np.int64)

    def batch(self, step: int, micro_index: int, micro_batch: int, num_micro: int):
        "(input_ids, labels), both int64 of shape (micro_batch, seq_len); labels are inputs shifted by one."
        ids = self.window_ids(step, micro_index, micro_batch, num_micro)
        rows = np.asarray(self.tokens[ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)], dtype=np.int64)
        x = torch.from_numpy(rows)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

# %% [markdown]
# Check the windows against a hand-made token array: input and label rows are slices of it.

# %%
toks = np.arange(1000, dtype=np.uint16) * 7 % 259
tw = TokenWindows(toks, seq_len=16, seed=0)
assert len(tw) == 999 // 16
ids = tw.window_ids(step=3, micro_index=1, micro_batch=4, num_micro=2)
x, y = tw.batch(step=3, micro_index=1, micro_batch=4, num_micro=2)
assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
for row, i in enumerate(ids):
    assert x[row].tolist() == toks[i * 16:i * 16 + 16].tolist()
    assert y[row].tolist() == toks[i * 16 + 1:i * 16 + 17].tolist()
assert (x[:, 1:] == y[:, :-1]).all()
# one epoch visits every window exactly once
epoch = np.concatenate([tw.window_ids(s, m, 4, 2) for s in range(len(tw) // 8) for m in range(2)])
assert len(set(epoch.tolist())) == len(epoch)

# %% [markdown]
# Sharding: two ranks read disjoint windows, and together exactly what one rank reads as twice the micro-batches,
# micro-batch for micro-batch.

# %%
ranks = [TokenWindows(toks, 16, seed=0, rank=r, world=2) for r in range(2)]
one = TokenWindows(toks, 16, seed=0)
for step in range(10):     # 10 steps × 8 samples crosses the epoch boundary at sample 62
    per_rank = [[w.window_ids(step, m, 4, 2) for m in range(2)] for w in ranks]
    a, b = np.concatenate(per_rank[0]), np.concatenate(per_rank[1])
    assert not set(a.tolist()) & set(b.tolist())
    assert [m.tolist() for m in per_rank[0] + per_rank[1]] == \
        [one.window_ids(step, m, 4, 4).tolist() for m in range(4)]
    assert torch.equal(ranks[1].batch(step, 1, 4, 2)[0], one.batch(step, 3, 4, 4)[0])
print("rank 0, step 0:", per_rank[0][0], "| rank 1:", per_rank[1][0])

# %% [markdown]
# Resuming: step 7 is the same batch whether steps 0–6 ran on this object or it was created fresh, and two
# constructions with the same seed agree; another seed gives another order.

# %%
ran = TokenWindows(toks, 16, seed=5)
for s in range(7):
    ran.batch(s, 0, 4, 1)
fresh = TokenWindows(toks, 16, seed=5)
assert all(torch.equal(a, b) for a, b in zip(ran.batch(7, 0, 4, 1), fresh.batch(7, 0, 4, 1)))
assert not np.array_equal(TokenWindows(toks, 16, seed=6).window_ids(7, 0, 4, 1), fresh.window_ids(7, 0, 4, 1))

# %% [markdown]
# ## Opening the data of a run
#
# `build_dataset` is what the trainer calls. For the corpus `"stdlib"` it tokenizes the embedded corpus once into
# `cache_dir`. The cache file's name is a hash of everything that determines its content (format version, the
# tokenizer's fingerprint, the Python version, and a hash of the selected files' names and bytes), so a
# different tokenizer or Python gets its own file, and a cached file that does not open cleanly or whose header
# does not match is rebuilt. Several
# ranks may start at once: each builds in its own temporary folder and renames the result into place, header
# last, so a reader never sees a partial file. For any other corpus value, it opens that packed file. It then
# checks the vocabulary rule and the tokenizer, splits off the last `val_frac` of the windows for validation,
# and returns `(train, val)`; `val` is `None` when `val_frac` is 0.

# %%
#| export
def stdlib_packed(tokenizer, cache_dir, max_bytes: int = STDLIB_BYTES) -> Path:
    "The embedded corpus tokenized by `tokenizer`, built into `cache_dir` unless already there: its base path."
    paths, texts = stdlib_corpus(max_bytes)
    source = _source(paths, texts)
    key = json.dumps([FORMAT_VERSION, tokenizer.fingerprint, source], sort_keys=True)
    base = Path(cache_dir) / f"stdlib-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if base.with_suffix(".json").exists():
        try:
            header = open_packed(base).header
        except (ValueError, FileNotFoundError) as e:   # a damaged cache: say why, then rebuild it below
            print(f"rebuilding the cached corpus {base}: {e}")
        else:
            if (header["tokenizer_fingerprint"], header["source"]) == (tokenizer.fingerprint, source):
                return base
    base.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base.parent, prefix=base.name + ".building-"))
    w = PackedWriter(tmp / "corpus", tokenizer, source)
    for t in texts:
        w.add(tokenizer.encode(t))
    w.finish()
    for suffix in (".bin", ".idx", ".json"):   # the header last: its presence means the rest is in place
        os.replace(tmp / f"corpus{suffix}", base.with_suffix(suffix))
    tmp.rmdir()
    return base

# %%
#| export
def build_dataset(corpus: str, tokenizer_spec: str, cache_dir, seq_len: int, seed: int, rank: int, world: int,
                  model_vocab_size: int, val_frac: float = 0.0):
    "(train, val) TokenWindows of `corpus` ('stdlib' or a packed path); val is None when val_frac is 0."
    tokenizer = load_tokenizer(tokenizer_spec, cache_dir)
    base = stdlib_packed(tokenizer, cache_dir) if corpus == "stdlib" else packed_base(corpus)
    data = open_packed(base)
    if data.header["tokenizer_fingerprint"] != tokenizer.fingerprint:
        raise InvalidInput(f"the data at {base} was tokenized with {data.header['tokenizer']!r}, not with "
                         f"{tokenizer_spec!r}: set the tokenizer to the one that made the data")
    check_vocab(data.header["vocab_size"], model_vocab_size, base)
    if not 0 <= val_frac < 1:
        raise InvalidInput(f"val_frac must be in [0, 1), got {val_frac}")
    n = len(TokenWindows(data.tokens, seq_len, seed))
    n_val = 0 if val_frac == 0 else max(1, round(n * val_frac))
    if n - n_val < 1:
        raise InvalidInput(f"{base} has only {n} windows of seq_len {seq_len}: nothing is left for training after "
                         f"val_frac={val_frac}; use more data, a shorter seq_len or val_frac=0")
    train = TokenWindows(data.tokens, seq_len, seed, rank, world, windows=range(n - n_val))
    val = TokenWindows(data.tokens, seq_len, seed, rank, world, windows=range(n - n_val, n)) if n_val else None
    return train, val

# %% [markdown]
# Build the default corpus into a scratch cache, check the split (validation windows are the last ones, disjoint
# from training), and see that a second call reuses the cache.

# %%
t0 = time.perf_counter()
cache = scratch / "cache"
train, val = build_dataset("stdlib", "bytes", cache, seq_len=128, seed=0, rank=0, world=1,
                           model_vocab_size=384, val_frac=0.01)
built = time.perf_counter() - t0
(cached,) = cache.glob("stdlib-*.json")
stamp = cached.stat().st_mtime_ns
t0 = time.perf_counter()
train2, _ = build_dataset("stdlib", "bytes", cache, 128, 0, 0, 1, 384, 0.01)
assert cached.stat().st_mtime_ns == stamp and len(list(cache.iterdir())) == 3     # reused, no leftovers
assert train.windows.stop == val.windows.start and val.windows.stop == (len(train.tokens) - 1) // 128
assert len(val) == round(0.01 * (len(train) + len(val)))
assert torch.equal(train.batch(4, 0, 8, 1)[0], train2.batch(4, 0, 8, 1)[0])
x, y = val.batch(0, 0, 2, 1)
assert x.max() < 259 and set(val.window_ids(0, 0, 2, 1).tolist()) <= set(val.windows)
print(f"{len(train.tokens):,} tokens: {len(train)} train + {len(val)} val windows of 128 "
      f"(built in {built:.1f} s, reopened in {time.perf_counter() - t0:.2f} s)")
print(repr(bt.decode(x[0][:80].tolist())))

# the default tokenizer: the BPE trained above (the same cache), its ids below 4096
bpe_train, _ = build_dataset("stdlib", "stdlib-bpe-4096", scratch / "tok", 128, 0, 0, 1, 4096, 0.01)
xb, _ = bpe_train.batch(0, 0, 2, 1)
assert xb.max() < 4096 and len(bpe_train.tokens) == n_tokens + len(all_texts)   # + one eos per document
print(f"stdlib-bpe-4096: {len(bpe_train.tokens):,} tokens, {len(bpe_train)} train windows of 128:",
      repr(tok.decode(xb[0][:24].tolist())))

# %% [markdown]
# A model whose vocabulary is smaller than the data's is refused before training starts:

# %%
try:
    build_dataset("stdlib", "bytes", cache, 128, 0, 0, 1, model_vocab_size=256)
    raise AssertionError("a too-small model vocabulary was accepted")
except ValueError as e:
    print(e)

# %%
shutil.rmtree(scratch)
