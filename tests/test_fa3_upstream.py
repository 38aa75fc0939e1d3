"""FlashAttention-3's own tests (``hopper/test_flash_attn.py``) run against
``attnlab.flash_attn_interface``: the cases attnlab claims, on a GPU.

    FA3_HOPPER_DIR=/path/to/flash-attention/hopper pytest -m gpu tests/test_fa3_upstream.py
    FA3_PYTEST_ARGS='-k "kvcache and bfloat16"' ...   # extra pytest arguments, e.g. a subset

The three files FA3's tests need (``test_flash_attn.py``, ``test_util.py``,
``padding.py``) are copied into a temporary folder beside a one-line
``flash_attn_interface.py`` that re-exports attnlab's module, so FA3's
``from flash_attn_interface import ...`` imports attnlab (copying, rather than adding
hopper/ to the path, keeps FA3's real module there from shadowing it).  FA3's own test
switches take out what attnlab does not claim, and a conftest deselects the rest by
parameter.  Needs einops (FA3's tests import it); rotary cases also need flash-attn's
``flash_attn.layers.rotary`` (without it FA3's file runs them with rotary_fraction 0).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# What FA3's test file imports from flash_attn_interface: the module must export them all.
FA3_TEST_IMPORTS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_combine",
                    "flash_attn_with_kvcache", "get_scheduler_metadata")

# FA3's own switches, and why each is off for attnlab.
FA3_SWITCHES = {
    "FLASH_ATTENTION_DISABLE_FP8": "its fp8 cases run fp8 queries against caches and varlen "
                                   "fp8, both refused (attnlab's fp8 paths: test_fp8.py)",
    "FLASH_ATTENTION_DISABLE_LOCAL": "its local cases also draw attention_chunk != 0 (refused); "
                                     "attnlab's window tests cover window_size",
    "FLASH_ATTENTION_DISABLE_HDIM64": "at d = 64 the tests also use a v head dim of 256 and 512",
    "FLASH_ATTENTION_DISABLE_HDIM192": "at d = 192 the tests also use a v head dim of 128",
}

# The claim: every test of the file, less these deselections (parameters -> reason).
CONFTEST = '''
import pytest

def _unclaimed(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    name = item.originalname
    if name == "test_flash3_bw_compatibility":
        return "checks torch.ops.flash_attn_3's schema, not the Python interface"
    if name == "test_flash_attn_kvcache":
        if params.get("page_size") in (1, 4):
            return "attnlab's paged caches take pages of a multiple of 16 tokens"
        if params.get("has_leftpad") and params.get("page_size") is not None:
            return "attnlab refuses cache_leftpad with a paged cache"
    return None

def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        (dropped if _unclaimed(item) else kept).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept
'''


def test_the_module_exports_what_fa3s_tests_import():
    import attnlab.flash_attn_interface as fa3

    assert set(FA3_TEST_IMPORTS) <= set(fa3.__all__)
    assert all(callable(getattr(fa3, name)) for name in FA3_TEST_IMPORTS)


@pytest.mark.gpu
@pytest.mark.skipif(not os.environ.get("FA3_HOPPER_DIR"),
                    reason="set FA3_HOPPER_DIR to a flash-attention checkout's hopper/ folder")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FA3's tests run on CUDA tensors only")
def test_fa3_hopper_suite_passes_against_attnlab(tmp_path):
    pytest.importorskip("einops", reason="FA3's tests import einops")
    hopper = Path(os.environ["FA3_HOPPER_DIR"])
    for name in ("test_flash_attn.py", "test_util.py", "padding.py"):
        shutil.copy(hopper / name, tmp_path / name)
    (tmp_path / "flash_attn_interface.py").write_text(
        "from attnlab.flash_attn_interface import *  # noqa: F403\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, **dict.fromkeys(FA3_SWITCHES, "TRUE"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(src),
                                          os.environ.get("PYTHONPATH", "")])}
    extra = os.environ.get("FA3_PYTEST_ARGS", "")
    done = subprocess.run(f"{sys.executable} -m pytest -q -p no:cacheprovider "
                          f"test_flash_attn.py {extra}", shell=True, cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
