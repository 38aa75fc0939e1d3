"""Shared test settings."""

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
