"""Shared test settings."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs on two shared cores: a wall-clock deadline per example would make the
# property tests fail on a slow moment rather than on a wrong answer.
settings.register_profile("attnlab", deadline=None)
settings.load_profile("attnlab")


@pytest.fixture
def json_from_fresh_python():
    """``run(script)``: the last stdout line of ``script`` run by a fresh Python without
    TRITON_INTERPRET, parsed as JSON.  Gluon does not compile under the interpreter
    (its reductions become interpreter functions), so the sm_90 compile tests use this."""
    def run(script: str):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                             env.get("PYTHONPATH", "")])
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])
    return run


BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(name: str):
    """A bench script as a module (bench/ on sys.path: forward_h200 imports backward_h200)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[key]


@pytest.fixture
def bench_script():
    """``bench_script(name)``: bench/<name>.py loaded as a module."""
    return load_bench_script
