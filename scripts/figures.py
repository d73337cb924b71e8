"""Render the figures that README.md shows into figures/, from the notebooks that draw them.

    python scripts/figures.py            # the tour and v01-v03 with their default CPU parameters, a few minutes

Each notebook runs through papermill (`jupytext --to ipynb X.py -o - | papermill - ...`) in a scratch folder, so
nothing else in the tree changes. The validation notebooks write their PNGs into `out_dir`; the tour draws its
loss curve inline, and its PNG is taken from the executed notebook's output. Every PNG is resampled to 90 dpi
and saved with a palette, so the committed figures stay small. A notebook that fails stops the script with its
log.
"""
import base64
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"
DPI = 90

# (notebook, [(the PNG it writes or None for its inline output, name, its dpi)]); kernels run at the repository root
# (the inline backend draws at 100 dpi)
NOTEBOOKS = [
    ("nbs/index.py", [(None, "tour_loss.png", 100)]),
    ("nbs/validate/v01_training.py", [("v01_training.png", "v01_training.png", 110)]),
    ("nbs/validate/v02_pipeline.py", [("v02_pipeline.png", "v02_pipeline.png", 110)]),
    ("nbs/validate/v03_ep.py", [("v03_ep.png", "v03_ep.png", 100)]),
]


def tool(name: str) -> str:
    "A console script beside this interpreter (the venv need not be activated)."
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


def run(nb: str, tmp: Path) -> Path:
    executed = tmp / (Path(nb).stem + ".out.ipynb")
    notebook = subprocess.run([tool("jupytext"), "--to", "ipynb", str(ROOT / nb), "-o", "-"], check=True,
                              capture_output=True).stdout
    proc = subprocess.run([tool("papermill"), "-", str(executed), "--cwd", str(ROOT), "-p", "out_dir", str(tmp),
                           "--no-progress-bar"], input=notebook, capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"{nb} failed:\n{proc.stderr.decode()[-4000:]}")
    return executed


def inline_png(executed: Path) -> bytes:
    "The last PNG the notebook displayed."
    pngs = [out["data"]["image/png"] for cell in json.loads(executed.read_text())["cells"]
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    if not pngs:
        sys.exit(f"{executed.name} displayed no figure")
    return base64.b64decode(pngs[-1])


def save(png: bytes, dpi: int, dest: Path) -> None:
    "Resample from the notebook's dpi to DPI, with a palette."
    img = Image.open(io.BytesIO(png)).convert("RGB")
    scale = DPI / dpi
    img = img.resize((round(img.width * scale), round(img.height * scale)), Image.LANCZOS)
    img.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(dest, optimize=True)
    print(f"wrote {dest.relative_to(ROOT)} ({img.width}x{img.height}, {dest.stat().st_size / 1024:.0f} KiB)")


def main() -> None:
    FIGURES.mkdir(exist_ok=True)
    for nb, figures in NOTEBOOKS:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"running {nb}", flush=True)
            executed = run(nb, Path(tmp))
            for written, name, dpi in figures:
                png = inline_png(executed) if written is None else (Path(tmp) / written).read_bytes()
                save(png, dpi, FIGURES / name)


if __name__ == "__main__":
    main()
