"""The one table of dtype names: attnlab's short names, the spellings it also takes, bytes.

attnlab writes a dtype as ``fp16``, ``bf16``, ``fp32`` or ``fp64`` (records, shapes,
plots); users write what their other tools write (``bfloat16``, ``float16``, ``half``,
``float32``), so every place that takes a dtype name reads it through
:func:`canonical_dtype`.  Pure Python: the torch dtype is named by its attribute
(``getattr(torch, TORCH_NAMES[name])``), so this module imports no tensor library.
"""

from __future__ import annotations

from typing import Any

from attnlab.checks import quote

# Bytes per element of each storage dtype attnlab knows, by its short name.
DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
# The name of each dtype's attribute on the torch module (torch.bfloat16, ...).
TORCH_NAMES: dict[str, str] = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32",
                               "fp64": "float64"}
# Every spelling taken, lower-case, to the short name: the short names, torch's and
# NumPy's names, and the C names torch also answers to (torch.half, torch.double).
ALIASES: dict[str, str] = {
    **{name: name for name in DTYPE_BYTES},
    **{torch_name: name for name, torch_name in TORCH_NAMES.items()},
    "half": "fp16", "float": "fp32", "double": "fp64",
}


# Storage-only dtypes: what a KV cache (or an FP8 prefill's q, k, v) may be stored in,
# never computed in.  Only the KV-cache models read these names (``kv_dtype``); every
# other dtype argument takes the compute dtypes above and refuses fp8.
FP8_TORCH_NAME = "float8_e4m3fn"  # OCP e4m3: finite max 448, NaN but no infinity
KV_DTYPE_BYTES: dict[str, int] = {**DTYPE_BYTES, "fp8": 1}
KV_ALIASES: dict[str, str] = {**ALIASES, "fp8": "fp8", "e4m3": "fp8", "fp8_e4m3": "fp8",
                              FP8_TORCH_NAME: "fp8"}


def canonical_dtype(value: Any, name: str = "dtype") -> str:
    """The short name of a dtype spelled any way :data:`ALIASES` knows (case and a
    ``torch.`` prefix ignored); a ValueError naming ``name`` and the spellings otherwise."""
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in ALIASES:
            return ALIASES[key]
    spellings = ", ".join(
        f"{short} ({', '.join(a for a, s in ALIASES.items() if s == short and a != short)})"
        for short in DTYPE_BYTES)
    raise ValueError(f"{name} must be one of {spellings}, got {quote(value)}")


def dtype_bytes(dtype: Any, name: str = "dtype") -> int:
    """Bytes per element of a dtype given by any of its names."""
    return DTYPE_BYTES[canonical_dtype(dtype, name)]


def canonical_kv_dtype(value: Any, name: str = "kv_dtype") -> str:
    """The short name of a KV cache's storage dtype: a compute dtype
    (:func:`canonical_dtype`) or ``fp8`` (e4m3: ``e4m3``, ``fp8_e4m3``, ``float8_e4m3fn``)."""
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in KV_ALIASES:
            return KV_ALIASES[key]
    raise ValueError(f"{name} must be fp16, bf16, fp32, fp64 or fp8 (e4m3, float8_e4m3fn; "
                     f"e5m2 and the fnuz variants are not stored), got {quote(value)}")


__all__ = ["ALIASES", "DTYPE_BYTES", "FP8_TORCH_NAME", "KV_ALIASES", "KV_DTYPE_BYTES",
           "TORCH_NAMES", "canonical_dtype", "canonical_kv_dtype", "dtype_bytes"]
