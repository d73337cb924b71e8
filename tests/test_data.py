"""The data pipeline beyond its notebooks: every error message of the packed format, `python -m pith_lit.tokenize`
killed by a signal and resumed, dtype selection, the Hugging Face tokenizer path, and the batch contract
(sharding, determinism, resumability, the train/val split)."""
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import ROOT, subprocess_env
from pith_lit.tokenize import input_files, main, read_documents, tokenize_files
from pith_lit.train.data import (
    ByteTokenizer, PackedWriter, TokenWindows, build_dataset, check_vocab, load_tokenizer, open_packed,
    stdlib_corpus, stdlib_packed, token_dtype)

torch.set_num_threads(1)


def make_packed(base, docs=("alpha", "beta gamma", "δ"), tokenizer=None):
    w = PackedWriter(base, tokenizer or ByteTokenizer(), source={"test": True})
    for d in docs:
        w.add((tokenizer or ByteTokenizer()).encode(d))
    return w.finish()


def raises(exc, fn, *args, **kw) -> str:
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    return str(info.value)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    "A real byte-level BPE tokenizer.json, trained here on a few KB of the standard library (no download)."
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


# ---------------------------------------------------------------------------------------------- tokenizers

def test_byte_tokenizer():
    bt = load_tokenizer("bytes")
    assert (bt.vocab_size, bt.eos_id, bt.bos_id, bt.pad_id) == (259, 257, 256, 258)
    text = "héllo ∑ 🐍\n"
    assert bt.encode(text) == list(text.encode()) and bt.decode(bt.encode(text)) == text
    assert bt.decode([256, 104, 105, 257, 258]) == "<bos>hi<eos><pad>"


def test_hf_tokenizer(bpe_path, tmp_path):
    ref = Tokenizer.from_file(str(bpe_path))
    tok = load_tokenizer(str(bpe_path))
    text = "def decode(self, s, _w=WHITESPACE.match):  # ∑"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == ref.get_vocab_size() == 320 and tok.eos_id == ref.token_to_id("</s>")
    # tokenize with it (uint16 for 320 ids), then train on it through build_dataset
    (tmp_path / "doc.txt").write_text(text * 40)
    main([str(tmp_path / "doc.txt"), "--out", str(tmp_path / "hf"), "--tokenizer", str(bpe_path)])
    data = open_packed(tmp_path / "hf")
    assert data.tokens.dtype == np.uint16 and data.header["vocab_size"] == 320
    assert data.doc(0).tolist() == tok.encode(text * 40) + [tok.eos_id]
    train, val = build_dataset(str(tmp_path / "hf"), str(bpe_path), tmp_path / "cache", 8, 0, 0, 1, 320)
    assert val is None and train.batch(0, 0, 2, 1)[0].max() < 320
    msg = raises(ValueError, build_dataset, str(tmp_path / "hf"), "bytes", tmp_path / "cache", 8, 0, 0, 1, 320)
    assert "was tokenized with" in msg and "not with 'bytes'" in msg


def test_tokenizer_errors(tmp_path, bpe_path):
    msg = raises(FileNotFoundError, load_tokenizer, str(tmp_path / "nope.json"))
    assert "no such file" in msg and "'bytes'" in msg
    tok = Tokenizer(models.BPE())
    tok.train_from_iterator(["no special tokens here"] * 5, trainers.BpeTrainer(vocab_size=40))
    tok.save(str(tmp_path / "noeos.json"))
    assert "none of the end-of-document tokens" in raises(ValueError, load_tokenizer, str(tmp_path / "noeos.json"))
    # the fingerprint follows the file's content
    changed = tmp_path / "changed.json"
    changed.write_text(bpe_path.read_text().replace('"</s>"', '"<|endoftext|>"'))
    assert load_tokenizer(str(changed)).fingerprint != load_tokenizer(str(bpe_path)).fingerprint


# ------------------------------------------------------------------------------------------- packed format

@pytest.mark.parametrize("vocab,dtype", [(2, "uint8"), (256, "uint8"), (257, "uint16"), (259, "uint16"),
                                         (65536, "uint16"), (65537, "uint32"), (151936, "uint32"),
                                         (2**32, "uint32")])
def test_dtype_selection(vocab, dtype):
    assert token_dtype(vocab).name == dtype


def test_dtype_of_written_data(tmp_path):
    class Small(ByteTokenizer):   # 256 ids with eos = 255: one byte per token
        vocab_size, eos_id, spec, fingerprint = 256, 255, "small", "small"
    make_packed(tmp_path / "u8", tokenizer=Small())
    assert open_packed(tmp_path / "u8").tokens.dtype == np.uint8
    assert (tmp_path / "u8.bin").stat().st_size == len("alpha") + len("beta gamma") + len("δ".encode()) + 3


def test_vocabulary_too_large_for_any_dtype():
    assert "does not fit uint32" in raises(ValueError, token_dtype, 2**32 + 1)


def test_header_dtype_too_small_for_vocabulary(tmp_path):
    make_packed(tmp_path / "c")
    h = json.loads((tmp_path / "c.json").read_text())
    (tmp_path / "c.json").write_text(json.dumps(dict(h, dtype="uint8")))
    msg = raises(ValueError, open_packed, tmp_path / "c")
    assert "a vocabulary of 259 tokens needs dtype uint16" in msg and "the header says uint8" in msg


def test_token_id_outside_vocabulary(tmp_path):
    w = PackedWriter(tmp_path / "c", ByteTokenizer(), source={})
    assert "token ids outside 0..258" in raises(ValueError, w.add, [1, 2, 300])


def test_missing_corpus(tmp_path):
    msg = raises(FileNotFoundError, open_packed, tmp_path / "nothing")
    assert "no packed corpus at" in msg and "python -m pith_lit.tokenize" in msg
    make_packed(tmp_path / "c")
    (tmp_path / "c.bin").unlink()
    assert "c.bin is missing" in raises(FileNotFoundError, open_packed, tmp_path / "c")


def test_incomplete_corpus(tmp_path):
    (tmp_path / "c.progress.json").write_text("{}")
    (tmp_path / "c.bin").write_bytes(b"\0\0")
    msg = raises(FileNotFoundError, open_packed, tmp_path / "c")
    assert "is incomplete" in msg and "re-run the same" in msg


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_truncated_file(tmp_path, suffix):
    make_packed(tmp_path / "c")
    f = tmp_path / f"c{suffix}"
    f.write_bytes(f.read_bytes()[:-2])
    msg = raises(ValueError, open_packed, tmp_path / "c.json")
    assert "truncated or corrupt" in msg and "but its header records" in msg


def test_bad_header(tmp_path):
    make_packed(tmp_path / "c")
    good = (tmp_path / "c.json").read_text()
    (tmp_path / "c.json").write_text(good[:-20])
    assert "is not valid JSON" in raises(ValueError, open_packed, tmp_path / "c")
    (tmp_path / "c.json").write_text("[1, 2]")
    assert "is not a pith_lit packed-token header" in raises(ValueError, open_packed, tmp_path / "c")
    h = json.loads(good)
    (tmp_path / "c.json").write_text(json.dumps(dict(h, version=99)))
    assert "has format version 99" in raises(ValueError, open_packed, tmp_path / "c")
    del h["num_docs"]
    (tmp_path / "c.json").write_text(json.dumps(h))
    assert "lacks the fields ['num_docs']" in raises(ValueError, open_packed, tmp_path / "c")


def test_model_vocabulary_rule(tmp_path):
    make_packed(tmp_path / "c", docs=["x" * 100])
    check_vocab(259, 259, "here")     # equal is fine
    check_vocab(259, 151936, "here")  # a larger model vocabulary is fine
    msg = raises(ValueError, build_dataset, str(tmp_path / "c"), "bytes", tmp_path, 8, 0, 0, 1, 258)
    assert "uses a vocabulary of 259 tokens but the model's vocab_size is 258" in msg and "at least 259" in msg
    train, _ = build_dataset(str(tmp_path / "c"), "bytes", tmp_path, 8, 0, 0, 1, 259)
    assert len(train) == 100 // 8


def test_corpus_shorter_than_one_window(tmp_path):
    assert len(TokenWindows(np.arange(10), 9, seed=0)) == 1
    msg = raises(ValueError, TokenWindows, np.arange(10), 10, 0)
    assert "has 10 tokens, fewer than one window of seq_len + 1 = 11" in msg
    make_packed(tmp_path / "c")   # 20 tokens
    msg = raises(ValueError, build_dataset, str(tmp_path / "c"), "bytes", tmp_path, 64, 0, 0, 1, 384)
    assert "fewer than one window of seq_len + 1 = 65" in msg
    msg = raises(ValueError, build_dataset, str(tmp_path / "c"), "bytes", tmp_path, 19, 0, 0, 1, 384, 0.5)
    assert "nothing is left for training" in msg


# ---------------------------------------------------------------------------------------- python -m tokenize

def test_tokenize_resumes_after_kill(tmp_path):
    """Kill the tokenizer with SIGKILL in the middle of an input, re-run it, and get the bytes of an uninterrupted
    run. Input 04.jsonl is a named pipe during the killed run, so the kill lands at a known place: after 00–03
    are recorded, while 04's documents are being written."""
    src = tmp_path / "in"
    src.mkdir()
    for i in range(4):
        (src / f"{i:02d}.txt").write_text(f"document {i}, ∑ and more\n" * 30)
    lines = [json.dumps({"text": f"line {j} " * 40, "n": j}) + "\n" for j in range(300)]
    (src / "04.jsonl").write_text("".join(lines))
    (src / "05.txt").write_text("the end")
    tokenize_files([src], tmp_path / "ref" / "c")   # the reference: an uninterrupted run

    (src / "04.jsonl").unlink()
    os.mkfifo(src / "04.jsonl")
    out = tmp_path / "out" / "c"
    proc = subprocess.Popen([sys.executable, "-m", "pith_lit.tokenize", str(src), "--out", str(out)], cwd=ROOT,
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:   # open the pipe's write end as soon as the tokenizer has opened its read end
        assert proc.poll() is None and time.monotonic() < deadline, "the tokenizer never reached 04.jsonl"
        try:
            fd = os.open(src / "04.jsonl", os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:   # ENXIO: no reader yet
            time.sleep(0.02)
    os.set_blocking(fd, True)
    progress = json.loads(out.with_suffix(".progress.json").read_text())
    assert progress["done"] == 4
    recorded = progress["num_tokens"] * 2
    os.write(fd, "".join(lines[:150]).encode())
    while out.with_suffix(".bin").stat().st_size <= recorded:   # part of 04 has reached the file
        assert time.monotonic() < deadline, "no data from 04.jsonl reached the output"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    os.close(fd)
    assert not out.with_suffix(".json").exists(), "a killed run must not leave a header"
    assert "is incomplete" in raises(FileNotFoundError, open_packed, out)
    assert out.with_suffix(".bin").stat().st_size > recorded   # the resume has to cut this back

    (src / "04.jsonl").unlink()
    (src / "04.jsonl").write_text("".join(lines))
    extra = tmp_path / "extra.txt"
    extra.write_text("x")
    msg = raises(ValueError, tokenize_files, [src, extra], out)
    assert "records an interrupted run with other input files" in msg
    r = subprocess.run([sys.executable, "-m", "pith_lit.tokenize", str(src), "--out", str(out)], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout and "after 4 of 6 files" in r.stdout
    for suffix in (".bin", ".idx", ".json"):
        assert out.with_suffix(suffix).read_bytes() == (tmp_path / "ref" / f"c{suffix}").read_bytes(), suffix
    assert not out.with_suffix(".progress.json").exists()


def test_tokenize_rerun_and_inputs(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "b.jsonl").write_text('{"body": "two"}\n\n{"body": "three"}\n')
    header = tokenize_files([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "o", field="body")
    assert header["num_docs"] == 3 and header["num_tokens"] == 3 + 3 + 5 + 3
    assert tokenize_files([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "o", field="body") == header
    msg = raises(ValueError, tokenize_files, [tmp_path / "a.txt"], tmp_path / "o")
    assert "already holds a finished corpus made from other inputs" in msg
    assert "has no string field 'text'" in raises(ValueError, list, read_documents(tmp_path / "b.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    assert "bad.jsonl:2 is not valid JSON" in raises(ValueError, list, read_documents(tmp_path / "bad.jsonl"))
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    assert "is not UTF-8 text" in raises(ValueError, list, read_documents(tmp_path / "latin.txt"))
    assert "does not exist" in raises(FileNotFoundError, input_files, [tmp_path / "none.txt"])
    (tmp_path / "x.csv").write_text("a,b")
    assert "expected a .txt file, a .jsonl file or a folder" in raises(ValueError, input_files, [tmp_path / "x.csv"])
    (tmp_path / "empty").mkdir()
    assert "no .txt or .jsonl files" in raises(ValueError, input_files, [tmp_path / "empty"])
    with pytest.raises(SystemExit):
        main([])
    assert "give the INPUT files or folders and --out PATH" in capsys.readouterr().err


def test_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # the summary's cache goes under the temp folder
    main(["--summary"])
    out = capsys.readouterr().out
    assert "corpus stdlib" in out and "windows of seq_len 128" in out and "a window, decoded:" in out
    assert list(tmp_path.glob("pith_lit/stdlib-*.json"))


# ----------------------------------------------------------------------------------------------- batches

TOKENS = (np.arange(4001) * 31 % 259).astype(np.uint16)   # 250 windows of 16


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharding(world):
    ranks = [TokenWindows(TOKENS, 16, seed=1, rank=r, world=world) for r in range(world)]
    one = TokenWindows(TOKENS, 16, seed=1)
    mb, nm = 3, 2
    for step in range(0, 30, 3):   # crosses epoch boundaries (250 windows, 6 × world samples per step)
        mine = [np.concatenate([w.window_ids(step, m, mb, nm) for m in range(nm)]) for w in ranks]
        for a in range(world):
            for b in range(a + 1, world):
                assert not set(mine[a].tolist()) & set(mine[b].tolist())
        glob = np.concatenate([one.window_ids(step, m, mb, nm * world) for m in range(nm * world)])
        assert np.array_equal(np.concatenate(mine), glob)
        for r, w in enumerate(ranks):
            x, y = w.batch(step, 1, mb, nm)
            gx, gy = one.batch(step, r * nm + 1, mb, nm * world)
            assert torch.equal(x, gx) and torch.equal(y, gy)


def test_determinism_and_epochs():
    a, b = TokenWindows(TOKENS, 16, seed=3), TokenWindows(TOKENS, 16, seed=3)
    for step in (0, 7, 123):
        xa, ya = a.batch(step, 0, 5, 2)
        xb, yb = b.batch(step, 0, 5, 2)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not np.array_equal(TokenWindows(TOKENS, 16, seed=4).permutation(0), a.permutation(0))
    assert not np.array_equal(a.permutation(1), a.permutation(0))
    # each epoch (250 samples = 25 steps of 10) visits every window exactly once
    for epoch in range(2):
        seen = np.concatenate([a.window_ids(s, 0, 10, 1) for s in range(25 * epoch, 25 * (epoch + 1))])
        assert sorted(seen.tolist()) == list(range(250))


def test_batch_contents_and_resume():
    ran, fresh = TokenWindows(TOKENS, 16, seed=0), TokenWindows(TOKENS, 16, seed=0)
    for s in range(40):
        ran.batch(s, 0, 4, 2)
        ran.batch(s, 1, 4, 2)
    x, y = ran.batch(40, 1, 4, 2)
    assert torch.equal(x, fresh.batch(40, 1, 4, 2)[0]) and torch.equal(y, fresh.batch(40, 1, 4, 2)[1])
    assert x.dtype == torch.int64 and x.shape == (4, 16)
    for row, w in enumerate(fresh.window_ids(40, 1, 4, 2)):
        assert x[row].tolist() == TOKENS[w * 16:w * 16 + 16].tolist()
        assert y[row].tolist() == TOKENS[w * 16 + 1:w * 16 + 17].tolist()
    assert "micro_index < num_micro" in raises(ValueError, fresh.batch, 0, 2, 4, 2)
    assert "rank 2 is outside" in raises(ValueError, TokenWindows, TOKENS, 16, 0, 2, 2)


def test_split(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefgh" * 100)   # 801 tokens with eos: 100 windows of 8
    tokenize_files([tmp_path / "t.txt"], tmp_path / "c")
    train, val = build_dataset(str(tmp_path / "c"), "bytes", tmp_path, 8, 0, 1, 2, 259, val_frac=0.1)
    assert (train.windows, val.windows) == (range(90), range(90, 100))
    assert (train.rank, train.world) == (1, 2)
    seen_val = {int(i) for s in range(5) for i in val.window_ids(s, 0, 2, 1)}
    seen_train = {int(i) for s in range(30) for i in train.window_ids(s, 0, 2, 1)}
    assert seen_val <= set(range(90, 100)) and seen_train <= set(range(90))


def test_stdlib_corpus_and_cache(tmp_path, capsys):
    paths, texts = stdlib_corpus()
    assert paths == stdlib_corpus()[0] and sum(len(t.encode()) for t in texts) <= 4_000_000
    assert not any("site-packages" in p.parts for p in paths)
    train, val = build_dataset("stdlib", "bytes", tmp_path, 128, 0, 0, 1, 384, 0.01)
    base = stdlib_packed(ByteTokenizer(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [base.name + s for s in (".bin", ".idx", ".json")]
    stamp = base.with_suffix(".bin").stat().st_mtime_ns
    assert stdlib_packed(ByteTokenizer(), tmp_path) == base and base.with_suffix(".bin").stat().st_mtime_ns == stamp
    header = open_packed(base).header
    assert header["num_docs"] == len(paths) and header["source"]["files"] == len(paths)
    # a damaged cache is rebuilt, with a message
    expected = train.batch(3, 0, 4, 1)[0]
    del train, val   # their memory maps must not be read once the file is cut below
    with open(base.with_suffix(".bin"), "r+b") as f:
        f.truncate(1000)
    again, _ = build_dataset("stdlib", "bytes", tmp_path, 128, 0, 0, 1, 384, 0.01)
    assert "rebuilding the cached corpus" in capsys.readouterr().out
    assert torch.equal(again.batch(3, 0, 4, 1)[0], expected)
