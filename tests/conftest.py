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


@pytest.fixture
def captured_replay():
    """``run(step)``: ``step()`` once on a side stream (the warm-up: compiles), once
    captured into a CUDA graph, the graph replayed once; returns the captured output."""
    import torch

    def run(step):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        graph.replay()
        torch.cuda.synchronize()
        return out
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


# The ways of reading a tensor's values on the host (tests/test_decode.py, test_fp8.py).
VALUE_READS = ("item", "tolist", "cpu", "numpy", "to", "__bool__", "__int__", "__float__",
               "__index__")


@pytest.fixture
def no_value_reads(monkeypatch):
    """Inside the ``with`` block every way of reading a tensor's values on the host raises,
    and the planned launches only count (Triton's interpreter would read the values it
    runs on): what the call itself does before its kernels."""
    import contextlib

    import torch

    from attnlab.kernels import _launch

    launched = []

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"the call read a tensor's values on the host ({name})")
        return read

    @contextlib.contextmanager
    def guard():
        with monkeypatch.context() as m:
            def count(self, *args):
                launched.append(self.launcher.kernel.fn.__name__)
            # Both names of a planned launch (``launch`` is ``__call__`` without the lookup).
            m.setattr(_launch.PlannedLaunch, "__call__", count)
            m.setattr(_launch.PlannedLaunch, "launch", count)
            for name in VALUE_READS:
                m.setattr(torch.Tensor, name, refuse(name))
            yield launched
    return guard
