"""Logical HBM traffic of attention kernels: exact bytes read and written, per kernel.

Logical means every load and store the algorithm issues is counted once against
HBM, as if no cache ever hit (cold cache, no sector padding, no spills).  Physical
DRAM counters differ: the peer H200 run measured ~4 MiB per head for fused kernels
whose logical count is 66 MiB, because K/V re-reads hit L2 (../shared/anchors/).
Use these counts to rank designs and to check the lesson's arithmetic, not to
predict ``dram__bytes_read.sum``.

Every result is a :class:`Traffic` record: kernels with reads and writes split by
operand, a scope ("head", "kv-group", "layer", "model") and a masking condition, so
a ratio can refuse to compare an unmasked baseline with a causal kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.checks import check_bool, check_int
from attnlab.dtypes import KV_DTYPE_BYTES, canonical_kv_dtype
from attnlab.masking import split_plan, tile_plan, visible_pairs
from attnlab.model import flops as flop_model
from attnlab.shapes import AttentionShape, check_shape, dtype_bytes

# Softmax statistics and split partials are FP32 in the shipped kernels (flash-attn,
# PyTorch's flash and cuDNN backends keep logsumexp in FP32 for range).
STATS_BYTES = 4
PARTIAL_BYTES = 4

SCOPES = ("head", "kv-group", "layer", "model")
SCOPE_LABELS = {
    "head": "per head (one query head of one sequence)",
    "kv-group": "per KV group (one KV head and the query heads sharing it, one sequence)",
    "layer": "per layer (all heads, whole batch)",
    "model": "per model (all attention layers, all heads, whole batch)",
}


@dataclass(frozen=True)
class KernelTraffic:
    """One kernel launch: bytes read and written per operand, and its useful FLOPs."""

    kernel: str
    reads: tuple[tuple[str, int], ...]
    writes: tuple[tuple[str, int], ...]
    flops: int

    @property
    def read_bytes(self) -> int:
        return sum(b for _, b in self.reads)

    @property
    def write_bytes(self) -> int:
        return sum(b for _, b in self.writes)

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "reads": dict(self.reads), "writes": dict(self.writes),
                "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
                "total_bytes": self.total_bytes, "flops": self.flops}


@dataclass(frozen=True)
class Traffic:
    """Logical HBM traffic of one algorithm on one shape, at one scope."""

    variant: str        # machine name, e.g. "fa2-forward"
    label: str          # what a reader sees, e.g. "FlashAttention-2 forward, causal"
    scope: str          # one of SCOPES
    condition: str      # masking condition: "unmasked", "causal", "window", "causal+window"
    shape: AttentionShape  # the shape the scope was taken from (as given)
    layers: int         # attention layers folded in (1 unless scope == "model")
    kernels: tuple[KernelTraffic, ...]
    assumptions: tuple[str, ...]

    @property
    def read_bytes(self) -> int:
        return sum(k.read_bytes for k in self.kernels)

    @property
    def write_bytes(self) -> int:
        return sum(k.write_bytes for k in self.kernels)

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    @property
    def scope_label(self) -> str:
        return SCOPE_LABELS[self.scope]

    def bytes_of(self, operand: str) -> int:
        """All bytes moved for one operand (reads plus writes, every kernel)."""
        return sum(b for k in self.kernels for name, b in (*k.reads, *k.writes) if name == operand)

    def as_dict(self) -> dict:
        return {"variant": self.variant, "label": self.label, "scope": self.scope,
                "scope_label": self.scope_label, "condition": self.condition,
                "layers": self.layers, "shape": self.shape.as_dict(),
                "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
                "total_bytes": self.total_bytes, "flops": self.flops,
                "kernels": [k.as_dict() for k in self.kernels],
                "assumptions": list(self.assumptions)}


def mask_condition(shape: AttentionShape) -> str:
    """The masking condition a traffic count belongs to; ratios compare only equal ones."""
    if shape.causal and shape.has_window:
        return "causal+window"
    if shape.causal:
        return "causal"
    return "window" if shape.has_window else "unmasked"


# ----- scope ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Scope:
    name: str
    shape: AttentionShape  # the heads and batch the count covers
    layers: int

    def kernel(self, name: str, reads: dict[str, int], writes: dict[str, int],
               flops: int) -> KernelTraffic:
        return KernelTraffic(name,
                             tuple((k, v * self.layers) for k, v in reads.items()),
                             tuple((k, v * self.layers) for k, v in writes.items()),
                             flops * self.layers)


def _scoped(shape: AttentionShape, scope: str, layers: int | None, *,
            packs_heads: bool = False) -> _Scope:
    check_shape(shape)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {list(SCOPES)}, got {scope!r}")
    if scope == "model":
        layers = check_int("layers", layers, minimum=1)  # scope='model' needs it
    elif layers is not None:
        raise ValueError(f"layers applies only to scope='model', not scope={scope!r}")
    if scope == "head":
        if packs_heads and shape.group_size > 1:
            raise ValueError("scope='head' is undefined when query heads share one K/V pass "
                             f"(group size {shape.group_size}); use scope='kv-group' or 'layer'")
        scoped = shape.replace(batch=1, query_heads=1, kv_heads=1)
    elif scope == "kv-group":
        scoped = shape.replace(batch=1, query_heads=shape.group_size, kv_heads=1)
    else:
        scoped = shape
    return _Scope(scope, scoped, layers if scope == "model" else 1)


def _score_bytes(shape: AttentionShape, score_dtype: str | None) -> int:
    return shape.element_bytes if score_dtype is None else dtype_bytes(score_dtype)


def _check_flag(value: object, name: str) -> bool:
    return check_bool(name, value)


# ----- naive materialising baselines --------------------------------------------------
def naive_traffic(shape: AttentionShape, *, kernels: int = 3, score_dtype: str | None = None,
                  scope: str = "head", layers: int | None = None) -> Traffic:
    """The explicit materialising baseline, unmasked: S and P written to HBM in full.

    ``kernels=3``: GEMM (Q K^T, scale folded in) -> softmax -> GEMM (P V), the lesson's
    132.00 MiB per head at N=4096, d=128, FP16.  ``kernels=4``: the scale is its own
    elementwise pass over S, which is what eager PyTorch launches (the peer ncu run
    shows GEMM, MulFunctor, softmax, GEMM): one more read and write of S, 196.00 MiB.
    ``score_dtype`` is the dtype S and P are stored in (default: the input dtype).
    GQA: every query head's GEMMs read its shared K/V head (no reuse counted).
    """
    check_shape(shape)
    if kernels not in (3, 4):
        raise ValueError(f"kernels must be 3 (scale folded into the GEMM) or 4 (separate scale "
                         f"pass, as eager PyTorch), got {kernels!r}")
    if shape.causal or shape.has_window:
        raise ValueError("naive_traffic models the unmasked baseline; for a causal shape use "
                         "naive_causal_traffic (the lower-triangular baseline)")
    sc = _scoped(shape, scope, layers)
    s, heads = sc.shape, sc.shape.batch * sc.shape.query_heads
    act = s.head_dim * s.element_bytes
    q_bytes, k_bytes = heads * s.seqlen_q * act, heads * s.seqlen_k * act
    scores = s.seqlen_q * s.seqlen_k
    score_bytes = heads * scores * _score_bytes(s, score_dtype)
    gemm_flops = 2 * s.head_dim * scores * heads
    stages = [sc.kernel("GEMM S = Q K^T" + (" (unscaled)" if kernels == 4 else " * scale"),
                        {"Q": q_bytes, "K": k_bytes}, {"S": score_bytes}, gemm_flops)]
    if kernels == 4:
        stages.append(sc.kernel("scale S *= 1/sqrt(d)", {"S": score_bytes},
                                {"S (scaled)": score_bytes},
                                flop_model.SCALE_FLOPS_PER_SCORE * scores * heads))
    stages += [
        sc.kernel("softmax P = softmax(S)", {"S (scaled)" if kernels == 4 else "S": score_bytes},
                  {"P": score_bytes}, flop_model.SOFTMAX_FLOPS_PER_SCORE * scores * heads),
        sc.kernel("GEMM O = P V", {"P": score_bytes, "V": k_bytes}, {"O": q_bytes}, gemm_flops),
    ]
    return Traffic(
        variant=f"naive-{kernels}k",
        label=f"naive materialising, {kernels} kernels, unmasked",
        scope=sc.name, condition="unmasked", shape=shape, layers=sc.layers,
        kernels=tuple(stages),
        assumptions=("S and P written to HBM in full and read back once each",
                     f"scores stored as {score_dtype or shape.dtype}",
                     "logical: no cache reuse"),
    )


def naive_causal_traffic(shape: AttentionShape, *, triangle: str = "half",
                         score_dtype: str | None = None, scope: str = "head",
                         layers: int | None = None) -> Traffic:
    """The causal baseline: a naive kernel that stores only the permitted part of S and P.

    ``triangle="half"`` is the lesson's idealisation: each triangle is exactly half of
    N_q x N_k (16.00 MiB each at N=4096 FP16; 68.00 MiB per head in all).  It needs a
    square causal mask without a window.  ``triangle="exact"`` stores exactly the
    pairs the mask permits (diagonal included: N(N+1)/2), for any mask.
    """
    check_shape(shape)
    if triangle not in ("half", "exact"):
        raise ValueError(f"triangle must be 'half' (the lesson's N^2/2 idealisation) or 'exact' "
                         f"(pairs the mask permits), got {triangle!r}")
    if not (shape.causal or shape.has_window):
        raise ValueError("naive_causal_traffic needs a masked shape (causal=True or a window); "
                         "use naive_traffic for the unmasked baseline")
    if triangle == "half" and (shape.has_window or shape.seqlen_q != shape.seqlen_k):
        raise ValueError("triangle='half' is defined for a square causal mask without a window; "
                         "use triangle='exact'")
    sc = _scoped(shape, scope, layers)
    s, heads = sc.shape, sc.shape.batch * sc.shape.query_heads
    act = s.head_dim * s.element_bytes
    q_bytes, k_bytes = heads * s.seqlen_q * act, heads * s.seqlen_k * act
    pairs = visible_pairs(s)
    # Half of N x N in bytes is an integer: element sizes are even.
    stored = heads * (s.seqlen_q * s.seqlen_k * _score_bytes(s, score_dtype) // 2
                      if triangle == "half" else pairs * _score_bytes(s, score_dtype))
    gemm_flops = 2 * s.head_dim * pairs * heads
    stages = (
        sc.kernel("GEMM S = Q K^T * scale (permitted part)", {"Q": q_bytes, "K": k_bytes},
                  {"S": stored}, gemm_flops),
        sc.kernel("softmax P = softmax(S) (permitted part)", {"S": stored}, {"P": stored},
                  flop_model.SOFTMAX_FLOPS_PER_SCORE * pairs * heads),
        sc.kernel("GEMM O = P V (permitted part)", {"P": stored, "V": k_bytes}, {"O": q_bytes},
                  gemm_flops),
    )
    return Traffic(
        variant=f"naive-causal-{triangle}",
        label=("idealised lower-triangular naive (triangle = half of N^2)" if triangle == "half"
               else "lower-triangular naive (exactly the permitted pairs)"),
        scope=sc.name, condition=mask_condition(shape), shape=shape, layers=sc.layers,
        kernels=stages,
        assumptions=("only the permitted part of S and P is stored, written once, read once",
                     "the lesson's idealisation: each triangle is exactly N_q*N_k/2 elements"
                     if triangle == "half" else "stored elements = pairs the mask permits",
                     f"scores stored as {score_dtype or shape.dtype}",
                     "logical: no cache reuse"),
    )


# ----- FlashAttention-2 forward -------------------------------------------------------
def kv_element_bytes(shape: AttentionShape, kv_dtype: str | None) -> int:
    """Bytes per K/V element: the cache's dtype (``fp8``: 1) or, None, the shape's."""
    return shape.element_bytes if kv_dtype is None else KV_DTYPE_BYTES[canonical_kv_dtype(kv_dtype)]


def is_fp8_cache(kv_dtype: str | None) -> bool:
    return kv_dtype is not None and canonical_kv_dtype(kv_dtype) == "fp8"


def descale_reads(kv_dtype: str | None, programs: int) -> dict[str, int]:
    """An fp8 cache's descales as reads: a K and a V factor (fp32) for every program that
    streams K/V (logical: none shared); nothing for a cache in a float dtype."""
    return {"K/V descales (fp32)": programs * 2 * STATS_BYTES} if is_fp8_cache(kv_dtype) else {}


def kv_rows_streamed(shape: AttentionShape) -> int:
    """K (or V) rows one head's fused forward loads, summed over its query tiles."""
    return tile_plan(check_shape(shape)).kv_rows_loaded()


def fused_forward_traffic(shape: AttentionShape, *, write_lse: bool = False,
                          pack_gqa: bool = False, scope: str = "head",
                          layers: int | None = None, kv_dtype: str | None = None) -> Traffic:
    """FlashAttention-2 forward: Q read once, O written once, K/V once per query tile.

    Each query tile loads every KV tile holding a key one of its rows may see (the
    causal skip bound; tiles straddling the diagonal are loaded and masked), ragged
    last tiles counted by their real rows.  ``write_lse`` adds the FP32 logsumexp
    (4 bytes per query row; the backward needs it).  ``pack_gqa``: the query heads
    sharing a KV head are processed in one pass over its K/V (each query tile holds
    block_m positions of all of them), so K/V are read once per KV head instead of
    once per query head.  ``kv_dtype``: the K/V storage (default the shape's; ``fp8``:
    e4m3, 1 byte, each query tile's program also reading a K and a V descale).
    """
    check_shape(shape)
    _check_flag(write_lse, "write_lse")
    _check_flag(pack_gqa, "pack_gqa")
    sc = _scoped(shape, scope, layers, packs_heads=pack_gqa)
    s = sc.shape
    q_heads = s.batch * s.query_heads
    kv_passes = s.batch * (s.kv_heads if pack_gqa else s.query_heads)
    act = s.head_dim * s.element_bytes
    q_bytes = q_heads * s.seqlen_q * act
    kv_bytes = kv_passes * kv_rows_streamed(s) * s.head_dim * kv_element_bytes(s, kv_dtype)
    reads = {"Q": q_bytes, "K": kv_bytes, "V": kv_bytes,
             **descale_reads(kv_dtype, kv_passes * tile_plan(s).query_tile_count)}
    writes = {"O": q_bytes}
    if write_lse:
        writes["LSE"] = q_heads * s.seqlen_q * STATS_BYTES
    pairs = visible_pairs(s)
    kernel_flops = (flop_model.MATMUL_FLOPS_PER_PAIR_PER_DIM * s.head_dim
                    + flop_model.SOFTMAX_FLOPS_PER_SCORE) * pairs * q_heads
    condition = mask_condition(shape)
    return Traffic(
        variant="fa2-forward",
        label=f"FlashAttention-2 forward, {condition}"
              + (", GQA packed" if pack_gqa and s.group_size > 1 else "")
              + (", fp8 (e4m3) KV cache" if is_fp8_cache(kv_dtype) else ""),
        scope=sc.name, condition=condition, shape=shape, layers=sc.layers,
        kernels=(sc.kernel(f"fused attention forward (B_r={s.block_m}, B_c={s.block_n})",
                           reads, writes, kernel_flops),),
        assumptions=("S and P never reach HBM",
                     "K/V re-read from HBM for every query tile (no L2 reuse)",
                     "fully future KV tiles skipped; diagonal tiles loaded and masked",
                     "LSE written in FP32" if write_lse else "no LSE write (forward-only)",
                     "FLOPs: matmuls and softmax on permitted pairs only"),
    )


def gqa_kv_bytes(shape: AttentionShape, *, scope: str = "layer",
                 layers: int | None = None) -> dict[str, int]:
    """K+V bytes of the fused forward with and without packing the query heads of a group."""
    unpacked = fused_forward_traffic(shape, pack_gqa=False, scope=scope, layers=layers)
    packed = fused_forward_traffic(shape, pack_gqa=True, scope=scope, layers=layers)
    return {"unpacked": unpacked.bytes_of("K") + unpacked.bytes_of("V"),
            "packed": packed.bytes_of("K") + packed.bytes_of("V")}


# ----- Flash-Decoding ------------------------------------------------------------------

def flash_decoding_traffic(shape: AttentionShape, *, num_splits: int, pack_gqa: bool = True,
                           write_lse: bool = False, scope: str = "layer",
                           layers: int | None = None, kv_dtype: str | None = None) -> Traffic:
    """Flash-Decoding: the KV sequence split across CTAs, then a logsumexp combine.

    Split kernel: each (split, query tile) reads its Q tile and, once, the K/V tiles of
    its split that the mask lets it see; it writes an FP32 partial output and an FP32
    partial LSE for its rows.  Combine kernel: reads every split's partials, writes O
    (and the final LSE if ``write_lse``).  Splits get ``ceil(kv_tiles / num_splits)``
    KV tiles each (:func:`attnlab.masking.split_plan`, flash-attn's rule); an empty
    trailing split still writes its partials, as flash-attn's does.
    ``pack_gqa`` (default, what decode kernels do): one pass over a KV head serves
    all query heads of its group.  ``kv_dtype``: the KV cache's storage dtype (default
    the shape's; ``fp8`` = e4m3, 1 byte); an fp8 cache's split programs each also read
    a K and a V descale (fp32), counted as "K/V descales (fp32)".
    """
    check_shape(shape)
    _check_flag(pack_gqa, "pack_gqa")
    _check_flag(write_lse, "write_lse")
    sc = _scoped(shape, scope, layers, packs_heads=pack_gqa)
    s = sc.shape
    splits = split_plan(s.kv_tiles, num_splits)
    plan = tile_plan(s)
    q_heads = s.batch * s.query_heads
    kv_passes = s.batch * (s.kv_heads if pack_gqa else s.query_heads)
    act = s.head_dim * s.element_bytes
    kv_act = s.head_dim * kv_element_bytes(s, kv_dtype)
    fp8 = is_fp8_cache(kv_dtype)
    kv_rows = sum(plan.kv_rows_loaded(r.start, r.stop) for r in splits)
    q_rows_read = sum(plan.query_rows_loading(r.start, r.stop) for r in splits)
    partial_o = num_splits * q_heads * s.seqlen_q * s.head_dim * PARTIAL_BYTES
    partial_lse = num_splits * q_heads * s.seqlen_q * PARTIAL_BYTES
    pairs = visible_pairs(s)
    split_flops = (flop_model.MATMUL_FLOPS_PER_PAIR_PER_DIM * s.head_dim
                   + flop_model.SOFTMAX_FLOPS_PER_SCORE) * pairs * q_heads
    # combine: per split and row, a max, an exp and a weighted add over d
    combine_flops = num_splits * q_heads * s.seqlen_q * (2 * s.head_dim + 3)
    combine_writes = {"O": q_heads * s.seqlen_q * act}
    if write_lse:
        combine_writes["LSE"] = q_heads * s.seqlen_q * STATS_BYTES
    condition = mask_condition(shape)
    split_reads = {"Q": q_heads * q_rows_read * act,
                   "K": kv_passes * kv_rows * kv_act, "V": kv_passes * kv_rows * kv_act,
                   # one split program per KV pass, split and query tile
                   **descale_reads(kv_dtype, kv_passes * num_splits * plan.query_tile_count)}
    return Traffic(
        variant="flash-decoding",
        label=f"Flash-Decoding, {num_splits} splits, {condition}"
              + (", GQA packed" if pack_gqa and s.group_size > 1 else "")
              + (", fp8 (e4m3) KV cache" if fp8 else ""),
        scope=sc.name, condition=condition, shape=shape, layers=sc.layers,
        kernels=(
            sc.kernel(f"split-KV attention ({num_splits} splits)", split_reads,
                      {"O partial (fp32)": partial_o, "LSE partial (fp32)": partial_lse},
                      split_flops),
            sc.kernel("combine partials (logsumexp)",
                      {"O partial (fp32)": partial_o, "LSE partial (fp32)": partial_lse},
                      combine_writes, combine_flops),
        ),
        assumptions=("each split reads its K/V once; Q read once per split",
                     "partial outputs and LSEs are FP32, written once and read once",
                     *(("K/V stored as e4m3 (1 byte), with fp32 descales",) if fp8 else ()),
                     "logical: no cache reuse"),
    )


# ----- backward ------------------------------------------------------------------------
BACKWARD_VARIANTS = ("two-pass", "atomic-dq", "attnlab", "attnlab-sm90")


def backward_traffic(shape: AttentionShape, *, variant: str = "two-pass", scope: str = "head",
                     layers: int | None = None, dq_tiles: tuple[int, int] | None = None,
                     dkdv_tiles: tuple[int, int] | None = None,
                     dkdv_split: bool = False,
                     dv_tiles: tuple[int, int] | None = None) -> Traffic:
    """FlashAttention-2 backward with recomputation: S and P rebuilt from Q, K and the LSE.

    Always a preprocess kernel D = rowsum(dO * O) (FP32 per query row).  Then
    ``"two-pass"`` (Triton's tutorial layout): a dK/dV pass with KV tiles outer that
    reads every visible Q, dO, LSE, D tile, and a dQ pass with query tiles outer that
    re-reads the visible K/V tiles.  ``"atomic-dq"`` (FA-2 Algorithm 2): one KV-outer
    pass that adds into an FP32 dQ accumulator in HBM for every visible tile pair
    (read and written each time), then a kernel converting it to the input dtype.
    With GQA (group > 1), every query head writes its own dK/dV and a reduction sums
    them per KV head, as flash-attn 2 does.

    ``"attnlab"`` is attnlab's own two launches (``kernels/backward.py``): no preprocess
    -- the dQ kernel (query tiles outer) runs first, forms D = rowsum(dO * O) from the O
    and dO rows it holds and writes it; then the dK/dV kernel, one program per (KV
    block, KV head), loops over the group's query heads with dK/dV in registers, so K/V
    are read and dK/dV written once per KV head and there is no reduction.
    ``"attnlab-sm90"`` is the same with the Gluon dK/dV kernel, for which the dQ kernel
    also writes LSE in log2 units, read in place of the LSE.  Each attnlab kernel has its
    own tiles, (query rows, key rows): ``dq_tiles`` (``BackwardConfig.dq_block_m/n``) and
    ``dkdv_tiles`` (``dkdv_block_m/n``, or the Gluon kernel's ``block_m`` and 128 keys);
    by default the shape's ``block_m``/``block_n`` (the model does not import the kernels'
    tables: :func:`attnlab.measure.compare.attnlab_backward_tiles` reads them).
    ``dkdv_split``: dK and dV formed apart, so the query rows travel twice and S is
    formed twice: one forming dV (reads Q, dO, LSE; computes S and P^T dO), one dK (Q,
    dO, LSE, D; S, dP and dS^T Q).  With ``"attnlab"`` (``BackwardConfig.dkdv_split``)
    they are two programs per key block of one launch, which reads K and V once; with
    ``"attnlab-sm90"`` (the Gluon kernel at d = 256,
    ``backward_sm90.ONE_GRADIENT_PER_LAUNCH``) two launches, the dV launch (``dv_tiles``,
    default ``dkdv_tiles``; it reads K, not V) then the dK launch (``dkdv_tiles``; K, V).
    """
    check_shape(shape)
    if variant not in BACKWARD_VARIANTS:
        raise ValueError(f"variant must be one of {list(BACKWARD_VARIANTS)}, got {variant!r}")
    if dkdv_split and not variant.startswith("attnlab"):
        raise ValueError(f"dkdv_split is attnlab's dK/dV kernels' (variant 'attnlab' or "
                         f"'attnlab-sm90'), got variant {variant!r}")
    if dv_tiles is not None and not (dkdv_split and variant == "attnlab-sm90"):
        raise ValueError("dv_tiles are the Gluon kernel's dV launch's (variant "
                         "'attnlab-sm90' with dkdv_split=True)")
    if not variant.startswith("attnlab") and (dq_tiles, dkdv_tiles) != (None, None):
        raise ValueError(f"dq_tiles/dkdv_tiles are attnlab's kernels' tiles; variant "
                         f"{variant!r} has B_r x B_c in both passes (the shape's)")
    sc = _scoped(shape, scope, layers)
    s = sc.shape
    heads = s.batch * s.query_heads
    act = s.head_dim * s.element_bytes
    d32 = s.head_dim * STATS_BYTES
    plan = tile_plan(s)
    q_rows_per_pair = plan.query_rows_times_tiles()  # Q rows over tile pairs
    kv_rows_per_pair = plan.kv_rows_loaded()         # K rows over tile pairs
    pairs = visible_pairs(s)
    qo = heads * s.seqlen_q * act
    kv = heads * s.seqlen_k * act
    stats = heads * s.seqlen_q * STATS_BYTES
    if variant.startswith("attnlab"):
        default = (s.block_m, s.block_n)
        dkdv_tiles = _tiles(dkdv_tiles or default, "dkdv_tiles")
        return _attnlab_backward(sc, shape, variant, _tiles(dq_tiles or default, "dq_tiles"),
                                 dkdv_tiles, pairs, bool(dkdv_split),
                                 _tiles(dv_tiles or dkdv_tiles, "dv_tiles"))
    stages = [sc.kernel("backward preprocess D = rowsum(dO * O)", {"O": qo, "dO": qo}, {"D": stats},
                        2 * s.head_dim * s.seqlen_q * heads)]
    if variant == "two-pass":
        stages.append(sc.kernel(
            "backward dK/dV pass (KV tiles outer)",
            {"K": kv, "V": kv, "Q": heads * q_rows_per_pair * act,
             "dO": heads * q_rows_per_pair * act, "LSE": heads * q_rows_per_pair * STATS_BYTES,
             "D": heads * q_rows_per_pair * STATS_BYTES},
            {"dK": kv, "dV": kv}, 8 * s.head_dim * pairs * heads))
        stages.append(sc.kernel(
            "backward dQ pass (query tiles outer)",
            {"Q": qo, "dO": qo, "LSE": stats, "D": stats,
             "K": heads * kv_rows_per_pair * act, "V": heads * kv_rows_per_pair * act},
            {"dQ": qo}, 6 * s.head_dim * pairs * heads))
    else:
        accum = heads * q_rows_per_pair * d32
        stages.append(sc.kernel("zero the FP32 dQ accumulator", {},
                                {"dQ accum (fp32)": heads * s.seqlen_q * d32}, 0))
        stages.append(sc.kernel(
            "backward main pass (KV tiles outer, atomic dQ)",
            {"K": kv, "V": kv, "Q": heads * q_rows_per_pair * act,
             "dO": heads * q_rows_per_pair * act, "LSE": heads * q_rows_per_pair * STATS_BYTES,
             "D": heads * q_rows_per_pair * STATS_BYTES, "dQ accum (fp32)": accum},
            {"dQ accum (fp32)": accum, "dK": kv, "dV": kv},
            flop_model.BACKWARD_MATMUL_FLOPS_PER_PAIR_PER_DIM * s.head_dim * pairs * heads))
        stages.append(sc.kernel("convert dQ accumulator to the input dtype",
                                {"dQ accum (fp32)": heads * s.seqlen_q * d32}, {"dQ": qo},
                                0))
    if s.group_size > 1:
        grouped = s.batch * s.kv_heads * s.seqlen_k * act
        stages.append(sc.kernel("GQA: sum dK/dV over each group's query heads",
                                {"dK": kv, "dV": kv}, {"dK (summed)": grouped,
                                                       "dV (summed)": grouped},
                                2 * (s.group_size - 1) * grouped // s.element_bytes))
    return Traffic(
        variant=f"fa2-backward-{variant}",
        label=f"FlashAttention-2 backward ({variant}), {mask_condition(shape)}",
        scope=sc.name, condition=mask_condition(shape), shape=shape, layers=sc.layers,
        kernels=tuple(stages),
        assumptions=("S and P recomputed from Q, K and the forward's LSE, never loaded",
                     f"tiles: B_r={s.block_m} query rows, B_c={s.block_n} key rows in both passes",
                     "LSE and D are FP32",
                     "logical: no cache reuse"),
    )


def _tiles(tiles, name: str) -> tuple[int, int]:
    if not (isinstance(tiles, tuple) and len(tiles) == 2):
        raise ValueError(f"{name} must be (query rows, key rows), got {tiles!r}")
    return check_int(f"{name}[0]", tiles[0], minimum=1), check_int(f"{name}[1]", tiles[1],
                                                                   minimum=1)


def _attnlab_backward(sc, shape: AttentionShape, variant: str, dq_tiles: tuple[int, int],
                      dkdv_tiles: tuple[int, int], pairs: int, split: bool,
                      dv_tiles: tuple[int, int]) -> Traffic:
    """backward_traffic's ``"attnlab"`` and ``"attnlab-sm90"`` (see there)."""
    s = sc.shape
    heads = s.batch * s.query_heads
    act = s.head_dim * s.element_bytes
    qo = heads * s.seqlen_q * act
    stats = heads * s.seqlen_q * STATS_BYTES
    kv_once = s.batch * s.kv_heads * s.seqlen_k * act  # per KV head: no GQA expansion
    # dQ: each query tile loads the K/V tiles its rows see (K/V rows over tile pairs);
    # dK/dV: each key block loads the query tiles that see it (Q rows over tile pairs).
    kv_rows = tile_plan(s.replace(block_m=dq_tiles[0], block_n=dq_tiles[1])).kv_rows_loaded()

    def query_rows(tiles):
        return tile_plan(s.replace(block_m=tiles[0], block_n=tiles[1])).query_rows_times_tiles()

    q_rows = query_rows(dkdv_tiles)
    lse = "LSE (log2)" if variant == "attnlab-sm90" else "LSE"
    dq_writes = {"dQ": qo, "D": stats, **({lse: stats} if lse != "LSE" else {})}
    dq = sc.kernel(f"attnlab dQ (query tiles outer, {dq_tiles[0]} x {dq_tiles[1]}; forms and "
                   "writes D)",
                   {"Q": qo, "dO": qo, "O": qo, "LSE": stats,
                    "K": heads * kv_rows * act, "V": heads * kv_rows * act},
                   dq_writes, 6 * s.head_dim * pairs * heads + 2 * s.head_dim * s.seqlen_q * heads)
    if split and variant == "attnlab-sm90":
        dv_rows = query_rows(dv_tiles)
        stages = (
            dq,
            sc.kernel(f"attnlab dV launch (Gluon, {dv_tiles[1]} keys x {dv_tiles[0]} rows, "
                      "the GQA group summed in registers)",
                      {"K": kv_once, "Q": heads * dv_rows * act, "dO": heads * dv_rows * act,
                       lse: heads * dv_rows * STATS_BYTES},
                      {"dV": kv_once}, 4 * s.head_dim * pairs * heads),
            sc.kernel(f"attnlab dK launch (Gluon, {dkdv_tiles[1]} keys x {dkdv_tiles[0]} rows, "
                      "the GQA group summed in registers)",
                      {"K": kv_once, "V": kv_once, "Q": heads * q_rows * act,
                       "dO": heads * q_rows * act, lse: heads * q_rows * STATS_BYTES,
                       "D": heads * q_rows * STATS_BYTES},
                      {"dK": kv_once}, 6 * s.head_dim * pairs * heads),
        )
    else:
        copies = 2 if split else 1  # the query rows each dK/dV program streams
        stages = (
            dq,
            sc.kernel(f"attnlab dK/dV (KV tiles outer, {dkdv_tiles[1]} keys x {dkdv_tiles[0]} "
                      "rows, the GQA group summed in registers"
                      f"{'; dK and dV by separate programs' if split else ''})",
                      {"K": kv_once, "V": kv_once, "Q": copies * heads * q_rows * act,
                       "dO": copies * heads * q_rows * act,
                       lse: copies * heads * q_rows * STATS_BYTES,
                       "D": heads * q_rows * STATS_BYTES},
                      {"dK": kv_once, "dV": kv_once},
                      (10 if split else 8) * s.head_dim * pairs * heads),
        )
    kernel = "the Gluon sm_90 dK/dV kernel" if variant == "attnlab-sm90" else "the Triton kernels"
    return Traffic(
        variant=f"{variant}-backward",
        label=f"attnlab backward ({kernel}), {mask_condition(shape)}",
        scope=sc.name, condition=mask_condition(shape), shape=shape, layers=sc.layers,
        kernels=stages,
        assumptions=("S and P recomputed from Q, K and the forward's LSE, never loaded",
                     "D formed by the dQ kernel from the O and dO rows it loads",
                     f"tiles: dQ {dq_tiles[0]} query rows x {dq_tiles[1]} keys, dK/dV "
                     f"{dkdv_tiles[1]} keys x {dkdv_tiles[0]} query rows"
                     + (f" (the dV launch's: {dv_tiles[1]} x {dv_tiles[0]})"
                        if split and variant == "attnlab-sm90" else ""),
                     "no dLSE read (the LSE output not differentiated)",
                     "LSE and D are FP32", "logical: no cache reuse"),
    )


# ----- comparisons ---------------------------------------------------------------------
@dataclass(frozen=True)
class TrafficRatio:
    baseline: str
    candidate: str
    ratio: float          # baseline bytes / candidate bytes
    matched: bool         # same masking condition on both sides
    label: str

    def as_dict(self) -> dict:
        return {"baseline": self.baseline, "candidate": self.candidate, "ratio": self.ratio,
                "matched": self.matched, "label": self.label}


def _comparable(shape: AttentionShape) -> AttentionShape:
    # Block sizes belong to the kernel, masking to the condition; the rest must match.
    return shape.replace(block_m=128, block_n=64, causal=False, window=(-1, -1))


def traffic_ratio(baseline: Traffic, candidate: Traffic, *,
                  cross_condition: bool = False) -> TrafficRatio:
    """How many times fewer bytes ``candidate`` moves than ``baseline``.

    Refuses (ValueError) to divide counts taken under different masking conditions
    unless ``cross_condition=True``, and then labels the result a cross-condition
    ratio: it mixes the masking change with the kernel change.
    """
    for name, value in (("baseline", baseline), ("candidate", candidate)):
        if not isinstance(value, Traffic):
            raise TypeError(f"{name} must be a Traffic record, got {type(value).__name__}")
    _check_flag(cross_condition, "cross_condition")
    if baseline.scope != candidate.scope or baseline.layers != candidate.layers:
        raise ValueError(f"scopes differ ({baseline.scope} vs {candidate.scope}); compare counts "
                         "taken at the same scope")
    if _comparable(baseline.shape) != _comparable(candidate.shape):
        raise ValueError("shapes differ beyond masking and block sizes: "
                         f"{baseline.shape.describe()} vs {candidate.shape.describe()}")
    matched = baseline.condition == candidate.condition
    if not matched and not cross_condition:
        raise ValueError(
            f"baseline is {baseline.condition} and candidate is {candidate.condition}: a "
            "cross-condition ratio mixes the masking change with the kernel change; compare "
            "matched conditions, or pass cross_condition=True to get it labelled as such")
    ratio = baseline.total_bytes / candidate.total_bytes
    label = (f"{ratio:.2f}x vs {baseline.label} (matched: both {baseline.condition})" if matched
             else f"{ratio:.2f}x CROSS-CONDITION ({baseline.condition} baseline / "
                  f"{candidate.condition} candidate): not attributable to either change")
    return TrafficRatio(baseline.variant, candidate.variant, ratio, matched, label)


def lesson_comparison(shape: AttentionShape, *, scope: str = "head",
                      layers: int | None = None, score_dtype: str | None = None,
                      write_lse: bool = False) -> dict:
    """The lesson's table: naive vs FA-2 unmasked, idealised causal naive vs FA-2 causal.

    Returns the four records and the two matched ratios (2.00x and 1.94x at the
    lesson's shape).  The causal rows use ``shape`` with causal=True, the unmasked
    rows with causal=False; a window is not part of this table.
    """
    check_shape(shape)
    if shape.has_window:
        raise ValueError("window must be (-1, -1) for the lesson's comparison table")
    unmasked, causal = shape.replace(causal=False), shape.replace(causal=True)
    kw = {"scope": scope, "layers": layers}
    naive = naive_traffic(unmasked, score_dtype=score_dtype, **kw)
    fused = fused_forward_traffic(unmasked, write_lse=write_lse, **kw)
    triangle = "half" if shape.seqlen_q == shape.seqlen_k else "exact"
    naive_causal = naive_causal_traffic(causal, triangle=triangle, score_dtype=score_dtype, **kw)
    fused_causal = fused_forward_traffic(causal, write_lse=write_lse, **kw)
    return {
        "rows": [naive, fused, naive_causal, fused_causal],
        "ratios": [traffic_ratio(naive, fused), traffic_ratio(naive_causal, fused_causal)],
    }
