# Sourced by every skills/*/check.sh after it has changed to the repository root: `fail MESSAGE`, the project's
# interpreter `$py` (so that a fresh shell needs no `source .venv/bin/activate`: the Quickstart's .venv/bin/python
# when it exists, else python3 on PATH), its console scripts (nbdev_test, jupytext, ...) first on PATH, and
# `need "MODULES"`, which fails naming the first module that does not import.
fail() { echo "$1"; echo FAIL; exit 1; }
if [ -x .venv/bin/python ]; then py=$PWD/.venv/bin/python; else py=$(command -v python3 || command -v python || true); fi
[ -n "$py" ] || fail "no python3 on PATH and no .venv: run the README's Quickstart"
bin=$(dirname "$py")
export PATH="$bin:$PATH"
need() {
  local err; err=$("$py" -c "import $1" 2>&1) ||
    fail "$(tail -1 <<<"$err") (with $py): run the README's Quickstart, or pip install -e \".[dev]\" there"
}
