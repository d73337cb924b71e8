"""README.md's commands, run as written, so that the documentation cannot drift from the code.

Every ```bash block of README.md runs, in the order of the file, with `bash -euo pipefail -c BLOCK`, from the
root of a copy of the repository's tracked files (so the checkout is never written to and the test repeats),
after the Quickstart: the Quickstart's run `runs/tiny` is copied from the checkout (CI's Quickstart made it), or
trained in the copy when the checkout has none. The virtual environment counts as activated, as the README asks
after the Quickstart: the directory of this interpreter comes first on PATH and VIRTUAL_ENV names its
environment.

A block does not run only when the line above its fence says why:
`<!-- not run by tests/test_readme.py: REASON -->` (GPUs, SLURM, an interactive server, the Quickstart itself,
which CI runs on a fresh clone).
"""
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT, subprocess_env

README = ROOT / "README.md"
SKIP = re.compile(r"^<!-- not run by tests/test_readme\.py: (.+?) -->$")
BLOCK_TIMEOUT = 600


@dataclass
class Block:
    line: int          # the line of the opening fence, from 1
    heading: str       # the nearest heading above it
    lang: str          # the fence's info string
    code: str
    skip: str | None   # the reason of a skip marker on the line above the fence, else None


def blocks(text: str) -> list[Block]:
    "Every fenced block of a markdown text, in order."
    out, heading, lines, i = [], "", text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            marker = SKIP.match(lines[start - 1].strip()) if start > 0 else None
            out.append(Block(start + 1, heading, line[3:].strip(), "\n".join(body) + "\n",
                             marker.group(1) if marker else None))
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
        i += 1
    return out


def test_skip_markers_sit_on_bash_blocks():
    "A marker anywhere but directly above a ```bash fence would skip nothing and mislead the reader."
    lines = README.read_text().splitlines()
    for n, line in enumerate(lines):
        if SKIP.match(line.strip()):
            assert n + 1 < len(lines) and lines[n + 1].startswith("```bash"), (
                f"README.md line {n + 1}: the marker must be the line right above a ```bash fence")
    quickstart = lines.index("<!-- quickstart -->")
    first = next(b for b in blocks(README.read_text()) if b.line > quickstart + 1)
    assert first.lang == "bash" and first.skip, "the Quickstart block must carry a skip marker (CI runs it)"


def copy_repository(dest: Path) -> None:
    "The tracked files as they are in the working tree (edits included), and the Quickstart's run if there is one."
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    for name in filter(None, names.split("\0")):
        src = ROOT / name
        if src.is_file():                       # a tracked file deleted in the working tree is gone here too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    if (ROOT / "runs/tiny/ckpt").is_dir():
        shutil.copytree(ROOT / "runs/tiny", dest / "runs/tiny")


def activated_env() -> dict:
    "What `source .venv/bin/activate` does to the environment, for the environment of this interpreter."
    bin_dir = Path(sys.executable).parent
    env = subprocess_env(VIRTUAL_ENV=bin_dir.parent)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env.pop("PYTHONHOME", None)
    return env


def run(code: str, cwd: Path, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    t = time.perf_counter()
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT)
    return proc, time.perf_counter() - t


def tail(text: str, n: int = 3000) -> str:
    "The end of a command's output, progress bars ('\\r') made into lines."
    return "\n".join(line for line in text.replace("\r", "\n").splitlines() if line.strip())[-n:]


def test_readme_commands_run(tmp_path):
    repo = tmp_path / "repo"
    copy_repository(repo)
    env = activated_env()
    if not (repo / "runs/tiny").exists():       # the Quickstart's training, as its first line runs it
        proc, _ = run("python -m pith_lit.train", repo, env)
        assert proc.returncode == 0, f"the Quickstart's training failed:\n{tail(proc.stdout)}\n{tail(proc.stderr)}"
    runnable = [b for b in blocks(README.read_text()) if b.lang == "bash" and b.skip is None]
    assert len(runnable) >= 5, f"only {len(runnable)} runnable bash blocks in README.md"
    times = []
    for b in runnable:
        try:
            proc, seconds = run(b.code, repo, env)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            raise AssertionError(f"README.md line {b.line} ({b.heading}) ran over {BLOCK_TIMEOUT} s:\n{b.code}\n"
                                 f"{tail(out)}") from None
        times.append(f"{seconds:5.1f} s  line {b.line} ({b.heading})")
        assert proc.returncode == 0, (
            f"README.md line {b.line} ({b.heading}) exited {proc.returncode}; the block:\n{b.code}\n"
            f"stdout:\n{tail(proc.stdout)}\nstderr:\n{tail(proc.stderr)}\n(blocks so far:\n" + "\n".join(times) + ")")
    print("\n".join(times))
    shutil.rmtree(repo, ignore_errors=True)     # a few hundred MB; kept only when a block failed
