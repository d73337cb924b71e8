"""Check that the notebooks' two forms and the exported package agree.

`nbs/**/*.py` (py:percent) is the source of truth. On a scratch copy of `nbs/` and `settings.ini`, this
rebuilds every `.ipynb` from its `.py` (`jupytext --to ipynb --update`, which keeps cell ids and outputs)
and exports the package afresh (`nbdev_export`), then compares the copy with the tree file by file. Any difference means something was edited on one side only or not exported. The tree
itself is never touched, so the check is safe on a dirty work tree.

    python scripts/sync_check.py [ROOT]      # exit 0 in sync, 1 with a list of what disagrees
"""
import filecmp, shutil, subprocess, sys, tempfile
from pathlib import Path

SKIP = shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints", "*.egg-info", "runs", "*.png")


def files(root: Path, sub: str) -> set[str]:
    base = root / sub
    if not base.exists():
        return set()
    return {str(p.relative_to(root)) for p in base.rglob("*") if p.is_file()
            and not any(part in ("__pycache__", ".ipynb_checkpoints", "runs") or part.endswith(".egg-info")
                        for part in p.relative_to(root).parts) and p.suffix != ".png"}


def nbdev_export() -> str:
    "The nbdev_export installed beside this interpreter (a virtual environment need not be activated)."
    beside = Path(sys.executable).parent / "nbdev_export"
    return str(beside) if beside.exists() else "nbdev_export"


def check(root: Path) -> list[str]:
    root = root.resolve()
    problems = []
    nbs = root / "nbs"
    for ipynb in sorted(nbs.rglob("*.ipynb")):
        if ".ipynb_checkpoints" not in ipynb.parts and not ipynb.with_suffix(".py").exists():
            problems.append(f"{ipynb.relative_to(root)} has no .py pair (jupytext --to py:percent it)")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        shutil.copytree(nbs, copy / "nbs", ignore=SKIP)
        shutil.copy(root / "settings.ini", copy / "settings.ini")
        sources = sorted(str(p) for p in (copy / "nbs").rglob("*.py"))
        for py in sources:
            if not Path(py).with_suffix(".ipynb").exists():
                problems.append(f"{Path(py).relative_to(copy)} has no .ipynb pair (jupytext --to ipynb it)")
        if sources:
            subprocess.run([sys.executable, "-m", "jupytext", "--quiet", "--to", "ipynb", "--update", *sources],
                           cwd=copy, check=True, capture_output=True)
        subprocess.run([nbdev_export()], cwd=copy, check=True, capture_output=True)
        before = files(root, "nbs") | files(root, "pith_lit")
        after = files(copy, "nbs") | files(copy, "pith_lit")
        for f in sorted(after - before):
            problems.append(f"{f} is missing from the tree (a new notebook or module not generated/committed)")
        for f in sorted(before - after):
            problems.append(f"{f} is not produced by any notebook (stale module, or hand-written file)")
        for f in sorted(before & after):
            if not filecmp.cmp(root / f, copy / f, shallow=False):
                problems.append(f"{f} differs from what its source produces")
    return problems


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    problems = check(root)
    if problems:
        print("OUT OF SYNC:\n  " + "\n  ".join(problems))
        print("Fix: jupytext --to ipynb --update nbs/<changed>.py && nbdev_export (or, after editing in "
              "Jupyter: jupytext --to py:percent nbs/<changed>.ipynb), then commit .py, .ipynb and pith_lit/.")
        sys.exit(1)
    print("in sync")


if __name__ == "__main__":
    main()
