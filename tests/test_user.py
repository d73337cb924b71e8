"""What a user of the command line meets: one-line errors with exit status 2 (the traceback with --debug), where a
run starts and what it refuses, a metrics.jsonl that holds each step once and only JSON, the validation loss,
empty inputs, and where the tokenized corpus is cached. Each runs `python -m ...` as a user would."""
import json
import subprocess
import sys

from conftest import ROOT, subprocess_env

QUICK = ["train.steps=4", "train.warmup=0", "train.global_batch=4", "train.seq_len=32", "log.tensorboard=false",
         "log.sample_tokens=0", "log.eval_every=2", "log.eval_windows=8", "ckpt.every=2"]


def run(module: str, *args: str, sets=(), timeout=240, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args, *[a for s in sets for a in ("--set", s)]]
    return subprocess.run(cmd, cwd=ROOT, env=env or subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


def train(run_dir, *extra, env=None) -> subprocess.CompletedProcess:
    return run("pith_lit.train", sets=[f"run.dir={run_dir}", *QUICK, *extra], env=env)


def one_line_error(proc, start: str):
    "Exit status 2, and the error is one line of its own, the last (a progress bar may come before it)."
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: " + start), proc.stderr[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in proc.stderr


def records(run_dir) -> list[dict]:
    def no_nan(name):
        raise ValueError(f"{name} is not JSON")
    return [json.loads(line, parse_constant=no_nan) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_says_where_it_starts_and_refuses_fewer_steps(tmp_path):
    d = tmp_path / "run"
    first = train(d)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "from scratch" in first.stdout and f"metrics {d / 'metrics.jsonl'}" in first.stdout
    assert f"checkpoint {d / 'ckpt' / 'step_00000004'}" in first.stdout
    config_time = (d / "config.toml").stat().st_mtime_ns
    again = train(d)
    assert again.returncode == 0 and "already at step 4 of 4: nothing to do" in again.stdout, again.stdout
    assert (d / "config.toml").stat().st_mtime_ns == config_time         # a run that trained nothing keeps it
    longer = train(d, "train.steps=6")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "resumed from step 4" in longer.stdout and "planned anew over 6 steps" in longer.stdout
    one_line_error(train(d, "train.steps=3"), "train.steps = 3: below step 6 of the checkpoint")
    assert [r["step"] for r in records(d)] == [1, 2, 3, 4, 5, 6]


def test_metrics_keep_each_step_once_and_only_json(tmp_path):
    "Lines a killed run wrote after its last checkpoint are dropped on resume; a NaN loss is written as null."
    d = tmp_path / "run"
    assert train(d).returncode == 0
    with open(d / "metrics.jsonl", "a") as f:         # as if steps 5 to 7 were logged, then the run was killed
        for step in (5, 6, 7):
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
        f.write('{"step": 8, "lo')                      # and a line cut short
    assert train(d, "train.steps=6").returncode == 0
    recs = records(d)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6] and all(r["loss"] != 1.0 for r in recs)
    assert [r["step"] for r in recs if "val_loss" in r] == [2, 4, 6]   # log.eval_every=2, and the last step
    nan = train(tmp_path / "nan", "train.lr=inf")
    one_line_error(nan, "loss is nan at step 2")
    bad = records(tmp_path / "nan")[-1]
    assert bad["loss"] is None and "loss" in bad["nonfinite"]


def test_user_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    one_line_error(train(tmp_path / "a", "data.corpus=no/such"), "no packed corpus at no/such")
    debug = run("pith_lit.train", "--debug", sets=[f"run.dir={tmp_path}/a", "data.corpus=no/such"])
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "MissingFile" in debug.stderr
    one_line_error(run("pith_lit.tokenize", str(tmp_path / "none.txt"), "--out", str(tmp_path / "t")),
                   f"input {tmp_path / 'none.txt'} does not exist")
    one_line_error(run("pith_lit.convert", "pith2hf", str(tmp_path), str(tmp_path / "hf")), f"{tmp_path} is neither")
    assert train(tmp_path / "b").returncode == 0                    # then the same run directory, another width
    one_line_error(train(tmp_path / "b", "model.hidden_size=64"), f"checkpoint {tmp_path / 'b' / 'ckpt'}")


def test_empty_inputs_are_named(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "text.txt").write_text("Some text to train on.\n")
    one_line_error(run("pith_lit.tokenize", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "e")),
                   "the inputs")
    assert not (tmp_path / "e.bin").exists()
    both = run("pith_lit.tokenize", str(tmp_path / "empty.txt"), str(tmp_path / "text.txt"), "--out",
               str(tmp_path / "b"))
    assert both.returncode == 0 and f"warning: {tmp_path / 'empty.txt'} holds no text" in both.stdout + both.stderr


def test_the_corpus_cache_lives_in_the_run_directory(tmp_path):
    "By default the tokenized corpus is built in run.dir/cache; $PITH_LIT_CACHE, then data.cache_dir, move it."
    env = subprocess_env()
    env.pop("PITH_LIT_CACHE", None)                 # the test session shares one cache through it (conftest)
    assert train(tmp_path / "run", env=env).returncode == 0
    assert (tmp_path / "run" / "cache").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    env["PITH_LIT_CACHE"] = str(tmp_path / "shared")
    assert train(tmp_path / "run2", env=env).returncode == 0
    assert not (tmp_path / "run2" / "cache").exists() and list((tmp_path / "shared").glob("stdlib-*.json"))
    assert train(tmp_path / "run3", f"data.cache_dir={tmp_path / 'own'}", env=env).returncode == 0
    assert list((tmp_path / "own").glob("stdlib-*.json")) and not (tmp_path / "run3" / "cache").exists()


def test_convert_says_which_tokenizer_to_train_with(tmp_path):
    "A Hugging Face checkpoint without tokenizer.json: hf2pith says where the tokenizer must come from."
    assert train(tmp_path / "run").returncode == 0
    assert run("pith_lit.convert", "pith2hf", str(tmp_path / "run"), str(tmp_path / "hf")).returncode == 0
    back = run("pith_lit.convert", "hf2pith", str(tmp_path / "hf"), str(tmp_path / "from-hf"))
    assert back.returncode == 0, back.stderr[-3000:]
    assert f"python -m pith_lit.train {tmp_path / 'from-hf' / 'config.toml'}" in back.stdout
    assert "ships no tokenizer.json" in back.stdout
