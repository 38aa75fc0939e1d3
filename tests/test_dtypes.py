"""The one dtype name table: both spellings everywhere a dtype is named (issue 30)."""

from __future__ import annotations

import json

import pytest

from attnlab.cli import main
from attnlab.dtypes import ALIASES, DTYPE_BYTES, TORCH_NAMES, canonical_dtype, dtype_bytes
from attnlab.shapes import AttentionShape

SPELLINGS = [("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"),
             ("BF16", "bf16"), ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"),
             ("fp32", "fp32"), ("float32", "fp32"), ("float", "fp32"), ("fp64", "fp64"),
             ("float64", "fp64"), ("double", "fp64")]


@pytest.mark.parametrize("spelling, short", SPELLINGS)
def test_every_spelling_names_one_short_name(spelling, short):
    assert canonical_dtype(spelling) == short
    assert AttentionShape(dtype=spelling).dtype == short
    assert dtype_bytes(spelling) == DTYPE_BYTES[short]


@pytest.mark.parametrize("bad", ["fp8", "int8", "", None, 16, "bfloat"])
def test_an_unknown_dtype_names_the_option_and_the_spellings(bad):
    with pytest.raises(ValueError, match=r"--dtype must be one of fp16 \(float16, half\), "
                                         r"bf16 \(bfloat16\)"):
        canonical_dtype(bad, "--dtype")


def test_the_table_matches_torch():
    torch = pytest.importorskip("torch")
    for short, name in TORCH_NAMES.items():
        assert getattr(torch, name).itemsize == DTYPE_BYTES[short]
    for alias, short in ALIASES.items():  # torch.half, torch.float, torch.double too
        if hasattr(torch, alias) and isinstance(getattr(torch, alias), torch.dtype):
            assert getattr(torch, alias) == getattr(torch, TORCH_NAMES[short])


@pytest.mark.parametrize("argv", [["traffic", "--json"], ["memory", "--json"],
                                  ["roofline", "--json"]])
def test_the_cli_takes_both_spellings(capsys, argv):
    outputs = []
    for spelling in ("bf16", "bfloat16"):
        assert main([*argv, "--dtype", spelling]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]


def test_bench_parses_a_torch_spelling_before_it_needs_a_gpu(capsys):
    """--dtype bfloat16 is taken; without CUDA the verb then says what it needs."""
    code = main(["bench", "--dtype", "bfloat16", "--providers", "eager", "--seqlens", "128"])
    err = capsys.readouterr().err
    assert "--dtype" not in err
    assert code == 2 and "CUDA" in err
