"""The BPE trained on the embedded corpus (pith_lit.train.data.stdlib_bpe, `python -m pith_lit.tokenize
--train-tokenizer`): offline and fast, deterministic, cached and rebuilt, loadable by transformers, and the rules that
tie it to the model's vocabulary."""
import subprocess
import sys
import time

import pytest
import transformers

from conftest import ROOT, subprocess_env
from pith_lit.train.config import ConfigError, load_config
from pith_lit.train.data import EOS_TOKEN, build_dataset, load_tokenizer, stdlib_bpe, stdlib_corpus


def test_command_trains_a_tokenizer_transformers_loads(tmp_path):
    "The command line writes a tokenizer.json in well under a minute; transformers reads the same ids from it."
    out = tmp_path / "tok" / "tokenizer.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pith_lit.tokenize", "--train-tokenizer", "2048", "--out", str(out)],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert took < 30, f"training the tokenizer took {took:.1f} s"
    assert "byte-level BPE of 2048 ids" in proc.stdout
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out))
    ours = load_tokenizer(str(out))
    text = stdlib_corpus(60_000)[1][-1]
    assert fast(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert fast.decode(ours.encode(text)) == text and len(fast) == ours.vocab_size == 2048
    assert ours.eos_id == fast.convert_tokens_to_ids(EOS_TOKEN)
    again = subprocess.run([sys.executable, "-m", "pith_lit.tokenize", "--train-tokenizer", "2048", "--out", str(out)],
                           cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already exists; choose another --out" in again.stderr
    small = subprocess.run([sys.executable, "-m", "pith_lit.tokenize", "--train-tokenizer", "200"],
                           cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert small.returncode == 2 and "needs at least 257 ids" in small.stderr
    assert not (tmp_path / "tokenizer.json").exists()


def test_cached_deterministic_and_rebuilt(tmp_path):
    "The cached tokenizer is reused, rebuilt with the same bytes when deleted, and another size is another file."
    a = stdlib_bpe(1024, tmp_path)
    data = a.read_bytes()
    stamp = a.stat().st_mtime_ns
    assert stdlib_bpe(1024, tmp_path) == a and a.stat().st_mtime_ns == stamp
    a.unlink()
    assert stdlib_bpe(1024, tmp_path) == a and a.read_bytes() == data
    b = stdlib_bpe(512, tmp_path)
    assert b != a and load_tokenizer("stdlib-bpe-512", tmp_path).vocab_size == 512
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.parent.name, b.parent.name])   # no leftovers


def test_default_data_uses_the_trained_tokenizer(tmp_path):
    "The default config's data: the BPE of 4096 ids, trained into the run's cache folder, its ids below 4096."
    cfg = load_config(overrides=[f"run.dir={tmp_path}"])
    assert (cfg.data.tokenizer, cfg.model.vocab_size) == ("stdlib-bpe-4096", 4096)
    train, val = build_dataset("stdlib", cfg.data.tokenizer, tmp_path / "cache", 128, 0, 0, 1, cfg.model.vocab_size,
                               0.01)
    assert list((tmp_path / "cache").glob("stdlib-bpe-4096-*/tokenizer.json"))
    x, y = train.batch(0, 0, 4, 1)
    assert x.max() < 4096 and len(train) > 8000
    tok = load_tokenizer(cfg.data.tokenizer, tmp_path / "cache")
    assert (train.tokens == tok.eos_id).sum() == len(stdlib_corpus()[0])   # one end-of-document per file


@pytest.mark.parametrize("over,message", [
    (["model.vocab_size=1000"], "data.tokenizer = 'stdlib-bpe-4096' has 4096 ids; use vocab_size >= 4096"),
    (["data.tokenizer=stdlib-bpe-12k"], "must be an integer >= 257"),
    (["data.tokenizer=stdlib-bpe-100"], "must be an integer >= 257"),
    (["data.tokenizer=bytes", "model.vocab_size=258"], "the byte tokenizer needs at least 259"),
])
def test_vocabulary_rules(over, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=over)
    assert load_config(overrides=["data.tokenizer=stdlib-bpe-1000", "model.vocab_size=1000"])
