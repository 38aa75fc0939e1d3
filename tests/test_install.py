"""The wheel a user installs: built with `python -m build`, installed into a fresh virtual
environment, and `attnlab demo` run from an empty folder finds the shipped H200 records.

The fresh environment gets attnlab from the wheel only; its dependencies (torch, rich,
...) come from this test run's environment through a .pth line, so no network is needed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the wheel is built from: the files `python -m build` reads, nothing else.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "src")
SHIPPED = ("attnlab/data/results/measure.jsonl", "attnlab/data/results/prefill_forward.jsonl",
           "attnlab/data/results/kernels.json", "attnlab/data/results/ncu/ncu_kernels.page.csv",
           "attnlab/explain/templates/page.html.j2", "attnlab/explain/static/explain.js",
           "attnlab/report/templates/report.html.j2")


def _run(argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, (f"{' '.join(map(str, argv))} exited {done.returncode}\n"
                                  f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="the `build` package (a dev dependency) is not installed")
    source = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    dist = tmp_path_factory.mktemp("dist")
    # --no-isolation: this environment already has setuptools (torch needs it); no network.
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist),
          str(source)], cwd=source)
    wheels = sorted(dist.glob("attnlab-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, got {wheels}"
    return wheels[0]


# Issue #27: a user who wants only the kernels downloads at most this.
WHEEL_BYTES_LIMIT = 1_500_000
# Makes the lab's libraries look uninstalled in a fresh environment (torch itself
# brings jinja2, so deleting packages cannot show what the core needs).
HIDE_LAB = """
import importlib.abc, sys
class _HideLab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _HideLab())
"""


def test_wheel_ships_the_committed_results(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in SHIPPED if name not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert not [n for n in names if "/runs/" in n or n.endswith(".png")], \
        "raw runs and plots stay in the repository's bench/results"


def test_the_wheel_is_small(wheel):
    assert wheel.stat().st_size <= WHEEL_BYTES_LIMIT, f"{wheel.stat().st_size:,} bytes"


def _fresh_environment(wheel: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A virtual environment holding attnlab from the wheel alone; its dependencies come
    from this test run's environment through a .pth line (no network)."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "--quiet", str(wheel)], cwd=tmp_path)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "attnlab_test_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return env_dir, site


def test_the_core_runs_without_the_lab(wheel, tmp_path):
    from attnlab.cli import LAB_DEPENDENCIES

    env_dir, site = _fresh_environment(wheel, tmp_path)
    (site / "sitecustomize.py").write_text(HIDE_LAB.format(hidden=set(LAB_DEPENDENCIES)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    script = ("import sys, torch, attnlab\n"
              "q = torch.randn(1, 5, 2, 16, dtype=torch.float64)\n"
              "out = attnlab.flash_attn_func(q, q, q, causal=True)\n"
              "ref = torch.nn.functional.scaled_dot_product_attention(\n"
              "    q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), is_causal=True)\n"
              "assert torch.allclose(out, ref.transpose(1, 2))\n"
              f"print(sorted(m for m in sys.modules if m.split('.')[0] in {set(LAB_DEPENDENCIES)!r}"
              " or m.startswith(('attnlab.model', 'attnlab.measure', 'attnlab.report'))))\n")
    done = _run([str(env_dir / "bin" / "python"), "-c", script], cwd=tmp_path, env=env)
    assert done.stdout.strip() == "[]"
    cli = subprocess.run([str(env_dir / "bin" / "attnlab"), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 2 and 'pip install "attnlab[lab]"' in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr


def test_demo_from_an_empty_folder_reads_the_shipped_records(wheel, tmp_path):
    env_dir, _ = _fresh_environment(wheel, tmp_path)
    python = env_dir / "bin" / "python"

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    done = _run([str(env_dir / "bin" / "attnlab"), "demo", "--out", "out"], cwd=empty, env=env)
    out = " ".join(done.stdout.split())  # rich wraps long lines

    installed = Path(_run([str(python), "-c", "import attnlab; print(attnlab.__file__)"],
                          cwd=empty, env=env).stdout.strip()).parent
    assert installed.is_relative_to(env_dir), f"attnlab imported from {installed}, not the wheel"
    assert not any(empty.glob("bench")), "the demo must not look for ./bench"
    shipped = installed / "data" / "results"
    # Named, not by this machine's path (issue 30): the count says which folder was read.
    found = re.search(r"(\d+) committed records in (\d+) file\(s\) under attnlab's "
                      r"committed H200 results", out)
    assert found, f"the demo's measure section did not list committed records:\n{out[-2000:]}"
    shipped_count = sum(1 for f in shipped.glob("*.jsonl")
                        for line in f.read_text().splitlines() if line.strip())
    assert int(found.group(1)) == shipped_count > 0
    assert int(found.group(2)) == len(list(shipped.glob("*.jsonl")))
    page_records = re.search(r"4 how much\W+(\d+) records", out)
    assert page_records and int(page_records.group(1)) > 0, \
        f"the explainer page found no records:\n{out[-2000:]}"
    assert (empty / "out" / "explain.html").is_file()
