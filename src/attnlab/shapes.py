"""The one data type for an attention workload, and named model presets.

Every other module (models, reference, kernel launchers, benchmark harness,
reports) takes an :class:`AttentionShape`.  Pure Python: no torch import, so the
exact models stay importable without a tensor library.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from attnlab.checks import check_bool, check_int, check_window, quote
from attnlab.dtypes import DTYPE_BYTES, canonical_dtype, dtype_bytes  # noqa: F401 (re-exported)


def format_tokens(tokens: int) -> str:
    """A token count as the lesson writes lengths: ``2048`` -> ``"2k"``, ``131072`` -> ``"128k"``,
    ``1000`` -> ``"1,000"`` (plots' tick labels and the explainer page share this one spelling)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    if tokens % 1024 == 0:
        return f"{tokens // 1024}k"
    return f"{tokens:,}"


@dataclass(frozen=True)
class AttentionShape:
    """One attention call: sizes, dtype, masking and the tile sizes a kernel uses.

    ``causal`` is aligned bottom-right (flash-attn's convention): query row i sees
    keys j <= i + seqlen_k - seqlen_q.  ``window`` is flash-attn's
    ``window_size=(left, right)``; -1 means unbounded on that side.
    ``block_m`` (B_r, query rows per tile) and ``block_n`` (B_c, key rows per tile)
    default to the lesson's 128 and 64.
    """

    batch: int = 1
    query_heads: int = 1
    kv_heads: int = 1
    seqlen_q: int = 4096
    seqlen_k: int = 4096
    head_dim: int = 128
    dtype: str = "fp16"
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    block_m: int = 128
    block_n: int = 64

    def __post_init__(self) -> None:
        for name in ("batch", "query_heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim",
                     "block_m", "block_n"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        if self.query_heads % self.kv_heads != 0:
            raise ValueError(
                f"kv_heads must divide query_heads, got query_heads={self.query_heads}, "
                f"kv_heads={self.kv_heads}"
            )
        # Stored by its short name, whichever spelling was given (bfloat16 -> bf16).
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "causal", check_bool("causal", self.causal))
        object.__setattr__(self, "window", check_window(self.window, name="window"))

    # ----- derived sizes -------------------------------------------------------
    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head (1 = MHA, query_heads = MQA)."""
        return self.query_heads // self.kv_heads

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def query_tiles(self) -> int:
        return -(-self.seqlen_q // self.block_m)

    @property
    def kv_tiles(self) -> int:
        return -(-self.seqlen_k // self.block_n)

    @property
    def has_window(self) -> bool:
        return self.window != (-1, -1)

    def replace(self, **changes) -> AttentionShape:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "window": list(self.window)}

    @classmethod
    def from_dict(cls, data: dict) -> AttentionShape:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown AttentionShape fields {sorted(map(str, unknown))[:8]}; "
                             f"known: {sorted(known)}")
        data = dict(data)
        if "window" in data:
            data["window"] = tuple(data["window"])
        return cls(**data)

    def describe(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.has_window:
            mask += f" window={self.window}"
        return (f"B={self.batch} Hq={self.query_heads} Hkv={self.kv_heads} "
                f"Nq={self.seqlen_q} Nk={self.seqlen_k} d={self.head_dim} {self.dtype} {mask}")


def check_shape(shape: object, name: str = "shape") -> AttentionShape:
    """``shape`` if it is an :class:`AttentionShape`; TypeError naming the type otherwise."""
    if not isinstance(shape, AttentionShape):
        raise TypeError(f"{name} must be an attnlab.AttentionShape, got {type(shape).__name__}")
    return shape


@dataclass(frozen=True)
class ModelPreset:
    """A transformer's attention geometry: what repeats per layer, and how often."""

    name: str
    description: str
    layers: int
    attention_layers: int  # layers that run softmax attention (the rest: other mixers)
    query_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    score_dtype: str  # dtype the naive path materialises S and P in
    parameters: int  # nominal parameter count: non-attention FLOPs are ~2 per parameter per token

    def shape(self, seqlen: int = 4096, *, batch: int = 1, causal: bool = True,
              seqlen_k: int | None = None, **overrides) -> AttentionShape:
        """One layer's attention call at a prompt length."""
        return AttentionShape(
            batch=batch, query_heads=self.query_heads, kv_heads=self.kv_heads,
            seqlen_q=seqlen, seqlen_k=seqlen if seqlen_k is None else seqlen_k,
            head_dim=self.head_dim, dtype=self.dtype, causal=causal, **overrides,
        )


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="lesson-8b",
            description="the lesson's nominal 8B dense model: 32 layers, 32 heads, d=128, FP16",
            layers=32, attention_layers=32, query_heads=32, kv_heads=32, head_dim=128,
            dtype="fp16", score_dtype="fp16", parameters=8_000_000_000,
        ),
        ModelPreset(
            name="qwen-gqa",
            description=("a Qwen-style hybrid: 64 layers of which 16 are full softmax attention, "
                         "24 query heads sharing 4 KV heads, d=256, bf16, FP32 scores"),
            layers=64, attention_layers=16, query_heads=24, kv_heads=4, head_dim=256,
            dtype="bf16", score_dtype="fp32", parameters=27_000_000_000,
        ),
    )
}


def preset(name: str) -> ModelPreset:
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {quote(name)}")
    return PRESETS[name]


# The lesson's default workload: one layer of the 8B model at N=4096, B_r=128, B_c=64.
LESSON_SHAPE = PRESETS["lesson-8b"].shape(4096, causal=False)
