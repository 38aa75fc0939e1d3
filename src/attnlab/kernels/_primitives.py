"""The @triton.jit pieces every attnlab kernel shares: the MMA, tile loads, the
online-softmax step.  Forward, backward and decode import them from here; a
kernel file holds only its own loop and launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from triton.runtime.jit import JITFunction

# exp(x) = exp2(x * log2(e)): the kernel works in base 2 (one MUFU.EX2 per score) and
# converts the LSE back to natural log with ln(2) = 0.6931471805599453 at the end.
LOG2E = 1.4426950408889634


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b in fp32.  UPCAST is for Triton's CPU interpreter only, whose bf16
    dot multiplies the raw 16-bit patterns (error ~2e10 on a 16x16 product in 3.6.0,
    3.7.1, 3.8.0 and 3.9.0 alike, so no released version may skip it); on a GPU the
    operands stay 16-bit."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _to_e4m3(x, EMULATE: tl.constexpr):
    """x >= 0 (softmax probabilities) as float8e4nv, rounded to nearest even.  On a GPU
    the one conversion (``cvt.rn.satfinite``).  EMULATE is for Triton's CPU interpreter,
    whose fp32 -> fp8 conversion truncates bit patterns (3.7.1: ties round up, a mantissa
    carry is lost so 0.99 -> 0.5, subnormals flush to 0): the rounding is done here in fp32
    first (step 2^(e-3) from the exponent bits, 2^-9 below 2^-6; 1.5 * 2^23 added and
    subtracted rounds to the nearest even integer), so the interpreter's cast only
    re-encodes an exact e4m3 value."""
    if EMULATE:
        rounded = _round_on_grid(x, 3, -6)
        x = tl.where(rounded > 448.0, 448.0, rounded)
    return x.to(tl.float8e4nv)


@triton.jit
def _round_on_grid(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """fp32 x rounded to nearest even on the grid of a float format with MANTISSA_BITS
    stored bits and normals from 2^MIN_EXPONENT (the subnormal step below), in fp32: the
    step 2^(e - MANTISSA_BITS) from x's exponent bits; 1.5 * 2^23 added and subtracted
    rounds x / step to the nearest even integer.  For Triton's CPU interpreter, whose
    narrowing casts (fp32 -> fp8, bf16, fp16) truncate: after this they re-encode an
    exact value.  MIN_EXPONENT - MANTISSA_BITS must be >= -126 (an fp32 normal step)."""
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXPONENT)
    step = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    return ((x / step + 12582912.0) - 12582912.0) * step


@triton.jit
def _load_kv_tile(base, stride_n, start_n, offs_d, seqlen_k,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  MASKED: tl.constexpr):
    """One (BLOCK_N, HEAD_DIM_PAD) tile of K or V from this (batch, kv head)'s base pointer;
    rows past seqlen_k and padded columns read 0."""
    return _load_strided_tile(base, stride_n, 1, start_n, offs_d, seqlen_k, BLOCK_N, HEAD_DIM,
                              HEAD_DIM_PAD, MASKED)


@triton.jit
def _load_strided_tile(base, stride_n, stride_d, start_n, offs_d, seqlen_k,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr):
    """:func:`_load_kv_tile` with a head-dim stride: the fp8 forward's V is stored with
    its keys contiguous (stride_n = 1), what an fp8 wgmma's k-major operand needs."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    ptrs = base + offs_n[:, None] * stride_n + offs_d[None, :] * stride_d
    if MASKED:
        # A band-edge tile may also be the ragged last tile of the sequence.
        return tl.load(ptrs, mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if HEAD_DIM != HEAD_DIM_PAD:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _online_softmax_step(qk, m_i, l_i, offs_m, start_n, seqlen_k, diag_offset,
                         window_left, window_right, qk_scale, softcap_log2, softcap_inv,
                         BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                         HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Scores of one tile -> probabilities p (base m_new), rescale alpha, new m and l."""
    if HAS_SOFTCAP:
        # softcap * tanh(s / softcap), kept in the log2 domain (softcap_log2 = softcap *
        # log2(e)) so the exponentials below stay exp2.
        qk = softcap_log2 * _softcap_tanh(qk, softcap_inv)
        score_scale = 1.0
    else:
        # The softmax scale is folded into the exp2 argument (one FMA per score).
        score_scale = qk_scale
    if MASKED:
        # The element mask: invisible scores become -inf before max and sum see them.
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = offs_n[None, :] < seqlen_k
        if HAS_RIGHT:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_offset + window_right)
        if HAS_LEFT:
            visible = visible & (offs_n[None, :] >= offs_m[:, None] + diag_offset - window_left)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * score_scale)
    # A row whose scores so far are all -inf (hidden keys, or -inf scores of an -inf key
    # in an unmasked tile too) keeps m = -inf; measuring from 0 instead makes exp2 give 0
    # rather than exp2(-inf + inf) = NaN.  One select per row and tile, not per score.
    # A NaN score is dropped by the max (maxnum) but not by the sum: l becomes NaN and
    # stays NaN, which _finish_rows turns into NaN O and LSE.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * score_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _row_sees_keys(offs_m, key_lo, key_hi, diag_offset, window_left, window_right,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Whether each row offs_m sees at least one key of [key_lo, key_hi): the band's
    closed form, per row (once, after the loop)."""
    first = tl.zeros_like(offs_m) + key_lo
    last = tl.zeros_like(offs_m) + (key_hi - 1)
    if HAS_LEFT:
        first = tl.maximum(first, offs_m + diag_offset - window_left)
    if HAS_RIGHT:
        last = tl.minimum(last, offs_m + diag_offset + window_right)
    return first <= last


@triton.jit
def _finish_rows(acc, l_i, m_i, sees_key):
    """(O, LSE in natural log) of each row from its final state: one division per row.

    l = 0 has two meanings, told apart by ``sees_key`` (:func:`_row_sees_keys`): a row
    that sees no key outputs O = 0, LSE = -inf (the convention); a row whose every
    visible score was -inf gives 0/0 = NaN, as softmax does, with LSE = log(0) = -inf.
    A NaN l (a NaN score, or a +inf score: exp2(inf - inf)) gives NaN O and NaN LSE:
    never mistaken for "saw no key", which an ``l > 0`` test would do (NaN > 0 is False),
    so a split-KV combine or a merge cannot drop it.  Costs nothing in the loop."""
    no_key = (l_i == 0.0) & ~sees_key
    l_safe = tl.where(no_key, 1.0, l_i)
    # Exactly 0, not acc / 1: a hidden key's NaN value in a loaded tile (p = 0 times
    # NaN in the MMA) must not reach a row that sees no key at all.
    out = tl.where(no_key[:, None], 0.0, acc / l_safe[:, None])
    lse = tl.where(no_key, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    return out, lse


# ---------------------------------------------------------------------------
# Index tensors read on the device (cache_seqlens, cache_leftpad, cache_batch_idx,
# block_table, seqused_k): every value is range-checked where a kernel reads it, a bad
# one is recorded in the per-device error record (kernels/index_checks.py: one int64
# triple per kind, the smallest ``sequence << 32 | x`` wins each slot) and replaced by a
# safe one, and the sequence's output is NaN.  Nothing is read on the host, so the
# launches need no synchronisation and capture in CUDA graphs.
# ---------------------------------------------------------------------------

@triton.jit
def _flag_index_error(ERRORS, KIND: tl.constexpr, seq, column, value, limit, bad):
    """Record a bad index of kind KIND for sequence ``seq`` where ``bad`` (scalars or
    vectors alike): where it was (column), what it held (value), the bound it broke."""
    slot = ERRORS + KIND * 3 + 0 * bad.to(tl.int32)  # one address per lane of ``bad``
    seq_key = seq.to(tl.int64) << 32
    tl.atomic_min(slot, seq_key | (column.to(tl.int64) & 0xFFFFFFFF), mask=bad)
    tl.atomic_min(slot + 1, seq_key | (value.to(tl.int64) & 0xFFFFFFFF), mask=bad)
    tl.atomic_min(slot + 2, seq_key | (limit.to(tl.int64) & 0xFFFFFFFF), mask=bad)


@triton.jit
def _sequence_bounds(ERRORS, seq, valid, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX,
                     cache_seqlen, seqlen_new, capacity, cache_batch,
                     HAS_SEQLENS: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                     HAS_BATCH_IDX: tl.constexpr, FLAG: tl.constexpr):
    """(cache_len, first live key, cache row, bad) of sequence(s) ``seq`` (lanes where
    ``valid``): cache_seqlens[seq] must lie in [0, capacity - seqlen_new],
    cache_leftpad[seq] in [0, cache_len], cache_batch_idx[seq] in [0, cache_batch).  A bad
    sequence reads as an empty one in row 0 (safe addresses) with ``bad`` set; FLAG
    records it (kinds 0-2 of kernels/index_checks.py)."""
    bad = seq < 0  # all False: a tensor of seq's shape to or into
    if HAS_SEQLENS:
        cache_len = tl.load(CACHE_SEQLENS + seq, mask=valid, other=0)
        bad_len = valid & ((cache_len < 0) | (cache_len > capacity - seqlen_new))
        if FLAG:
            _flag_index_error(ERRORS, 0, seq, 0 * seq, cache_len, capacity - seqlen_new + 0 * seq,
                              bad_len)
        bad = bad | bad_len
    else:
        cache_len = cache_seqlen + 0 * seq  # host-checked
    first = 0 * seq
    if HAS_LEFTPAD:
        first = tl.load(CACHE_LEFTPAD + seq, mask=valid, other=0)
        bad_first = valid & ((first < 0) | (first > cache_len))
        if FLAG:
            _flag_index_error(ERRORS, 1, seq, 0 * seq, first, cache_len, bad_first)
        bad = bad | bad_first
    row = seq
    if HAS_BATCH_IDX:
        row = tl.load(CACHE_BATCH_IDX + seq, mask=valid, other=0)
        bad_row = valid & ((row < 0) | (row >= cache_batch))
        if FLAG:
            _flag_index_error(ERRORS, 2, seq, 0 * seq, row, cache_batch + 0 * seq, bad_row)
        bad = bad | bad_row
    cache_len = tl.where(bad, 0, cache_len)
    first = tl.where(bad, 0, first)
    row = tl.where(bad, 0, row)
    return cache_len, first, row, bad


@triton.jit
def _page_entries(block_table_row, start_n, seqlen_k, limit, BLOCK_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, PER_PAGE: tl.constexpr = False):
    """The block table's raw entries for keys [start_n, start_n + BLOCK_N) of one sequence,
    in :func:`_checked_pages`' form: one (a scalar) when the tile lies in one page; with
    PER_PAGE (the decode kernel's tiles, which start at multiples of BLOCK_N) a tile
    spanning pages reads its BLOCK_N / PAGE_SIZE entries once; else one per key (the
    forward's paged varlen tiles).
    Entries are read only for keys below both ``limit`` and seqlen_k (0 elsewhere)."""
    if PAGE_SIZE % BLOCK_N != 0 and PER_PAGE and BLOCK_N % PAGE_SIZE == 0:
        column = start_n // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
        first_key = column * PAGE_SIZE
        entries = tl.load(block_table_row + column,
                          mask=(first_key < seqlen_k) & (first_key < limit), other=0)
    elif PAGE_SIZE % BLOCK_N == 0:
        # A tensor, not a Python bool, whatever start_n is (the interpreter's loop index).
        first_key = start_n + tl.zeros([], dtype=tl.int32)
        entries = tl.load(block_table_row + first_key // PAGE_SIZE,
                          mask=(first_key < seqlen_k) & (first_key < limit), other=0)
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        entries = tl.load(block_table_row + offs_n // PAGE_SIZE,
                          mask=(offs_n < seqlen_k) & (offs_n < limit), other=0)
    return entries


@triton.jit
def _checked_pages(ERRORS, seq, entries, start_n, seqlen_k, num_pages,
                   BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PER_PAGE: tl.constexpr = False):
    """(page, bad) of keys [start_n, start_n + BLOCK_N) from their :func:`_page_entries`:
    a scalar page, or one per key (a spanning PER_PAGE tile's entries broadcast over their
    keys; padded keys read entry 0).  An entry outside [0, num_pages) is recorded (kind 3),
    read as page 0, and ``bad`` is set: its keys are never loaded from where it points."""
    if PAGE_SIZE % BLOCK_N != 0 and PER_PAGE and BLOCK_N % PAGE_SIZE == 0:
        column = start_n // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
        bad = (column * PAGE_SIZE < seqlen_k) & ((entries < 0) | (entries >= num_pages))
    elif PAGE_SIZE % BLOCK_N == 0:
        column = start_n // PAGE_SIZE
        bad = (entries < 0) | (entries >= num_pages)
    else:
        column = (start_n + tl.arange(0, BLOCK_N)) // PAGE_SIZE
        bad = (start_n + tl.arange(0, BLOCK_N) < seqlen_k) & ((entries < 0) |
                                                             (entries >= num_pages))
    _flag_index_error(ERRORS, 3, seq + 0 * column, column, entries, num_pages + 0 * column, bad)
    page = tl.where(bad, 0, entries)
    if PAGE_SIZE % BLOCK_N != 0 and PER_PAGE and BLOCK_N % PAGE_SIZE == 0:
        page = tl.reshape(tl.broadcast_to(page[:, None], (BLOCK_N // PAGE_SIZE, PAGE_SIZE)),
                          (BLOCK_N,))
    # A scalar entry's flag as is, a vector's reduced (a constexpr choice: one side built).
    any_bad = bad.to(tl.int32) if PAGE_SIZE % BLOCK_N == 0 else tl.max(bad.to(tl.int32), 0)
    return page.to(tl.int64), any_bad


@triton.jit
def _load_cache_tile(base, page, stride_page, stride_n, start_n, offs_d, seqlen_k,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
                     PER_PAGE: tl.constexpr = False):
    """Keys [start_n, start_n + BLOCK_N) of one sequence and KV head, (BLOCK_N, HEAD_DIM_PAD).

    PAGE_SIZE == 0: contiguous, ``base`` points at the sequence's first live key and
    ``page`` is unused.  Otherwise ``base`` points at the KV head inside page 0 and
    ``page`` is :func:`_checked_pages`' answer for this tile (with the same PER_PAGE)."""
    if PAGE_SIZE == 0:
        # Advance the base in 64 bits; the in-tile offsets stay small.
        return _load_kv_tile(base + tl.cast(start_n, tl.int64) * stride_n, stride_n, 0, offs_d,
                             seqlen_k - start_n, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, MASKED)
    if PER_PAGE and PAGE_SIZE % BLOCK_N == 0:
        # One page holds the tile: one scalar base, then a contiguous tile's addresses.
        tile = base + page * stride_page + tl.cast(start_n % PAGE_SIZE, tl.int64) * stride_n
        return _load_kv_tile(tile, stride_n, 0, offs_d, seqlen_k - start_n, BLOCK_N, HEAD_DIM,
                             HEAD_DIM_PAD, MASKED)
    if PER_PAGE and BLOCK_N % PAGE_SIZE == 0:
        # Page-local offsets of a tile that starts on a page boundary: runs of PAGE_SIZE
        # contiguous rows the compiler can see.
        offs_n = start_n + tl.arange(0, BLOCK_N)
        rows = page * stride_page + (tl.arange(0, BLOCK_N) % PAGE_SIZE) * stride_n
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        rows = page * stride_page + (offs_n % PAGE_SIZE) * stride_n
    ptrs = base + rows[:, None] + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM),
                       other=0.0)
    if HEAD_DIM != HEAD_DIM_PAD:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tl.load(ptrs)


# TRITON_INTERPRET=1 at import makes every @triton.jit an InterpretedFunction.
INTERPRETED = not isinstance(_mma, JITFunction)


def kernel_is_interpreted() -> bool:
    """True when Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1 at import);
    RuntimeError when this Triton's interpreter cannot run beside this NumPy."""
    conflict = _interpreter_numpy_conflict() if INTERPRETED else None
    if conflict:
        raise RuntimeError(conflict)
    return INTERPRETED


def launch_is_traced(t: torch.Tensor) -> bool:
    """True when torch traces a launcher instead of running it: Dynamo, or tensors without
    data of their own (fake ones, functional wrappers), as the ops' decomposition for
    Inductor passes them.  Such a call must launch through ``torch.library.wrap_triton``;
    a real call launches directly: outside a ``triton_op`` body ``wrap_triton`` sends
    every launch through its HOP dispatcher, ~0.2 ms a forward on the H200."""
    if type(t) is torch.Tensor:
        return torch.compiler.is_compiling()
    return isinstance(t, FakeTensor | FunctionalTensor) or torch.compiler.is_compiling()


def _interpreter_numpy_conflict() -> str | None:
    """Triton 3.6's interpreter converts 1-element arrays with int(), which NumPy >= 2.4
    refuses (a TypeError deep inside every launch); Triton 3.7.1's does not (both checked
    with NumPy 2.4.6), so only that pairing is refused, here, with the way out."""
    import numpy

    triton_minor = tuple(int(p) for p in triton.__version__.split(".")[:2])
    numpy_minor = tuple(int(p) for p in numpy.__version__.split(".")[:2])
    if triton_minor < (3, 7) and numpy_minor >= (2, 4):
        return (f"Triton {triton.__version__}'s CPU interpreter cannot run with NumPy "
                f"{numpy.__version__} (it needs NumPy < 2.4); install 'numpy<2.4' or "
                f"Triton >= 3.7")
    return None


# ---------------------------------------------------------------------------
# Band bounds and the softcap, shared by the backward kernels (and available to the
# forward: _kv_band_bounds is the forward's inline arithmetic as one function).
#
# Bottom-right alignment: query i sees key j iff
#   i + diag_offset - window_left <= j <= i + diag_offset + window_right,
# with diag_offset = seqlen_k - seqlen_q and a side bounded only when HAS_LEFT/HAS_RIGHT.
# Each function returns four bounds lo <= full_lo <= full_hi <= hi: tiles in [lo, hi)
# are loaded (the skip bound), those in [full_lo, full_hi) are seen in full by every
# row of the block and run without the element mask; the rest run masked.
# ---------------------------------------------------------------------------

@triton.jit
def _kv_band_bounds(m_first, m_last, seqlen_k, diag_offset, window_left, window_right,
                    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key range seen from the query block [m_first, m_last]: (kv_lo, full_lo, full_hi, kv_hi).

    The ragged last key tile is never "full" (its padded keys need the mask)."""
    kv_lo = 0
    kv_hi = seqlen_k
    if HAS_LEFT:
        kv_lo = tl.maximum(m_first + diag_offset - window_left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        kv_hi = tl.minimum(tl.maximum(m_last + diag_offset + window_right + 1, 0), seqlen_k)
    kv_hi = tl.maximum(kv_hi, kv_lo)
    full_lo = kv_lo
    full_hi = seqlen_k // BLOCK_N * BLOCK_N
    if HAS_LEFT:
        first_full = tl.maximum(m_last + diag_offset - window_left, 0)
        full_lo = tl.maximum(kv_lo, tl.cdiv(first_full, BLOCK_N) * BLOCK_N)
    if HAS_RIGHT:
        last_full = tl.maximum(m_first + diag_offset + window_right + 1, 0)
        full_hi = tl.minimum(full_hi, last_full // BLOCK_N * BLOCK_N)
    full_lo = tl.minimum(full_lo, kv_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), kv_hi)
    return kv_lo, full_lo, full_hi, kv_hi


@triton.jit
def _q_band_bounds(n_first, n_last, seqlen_q, diag_offset, window_left, window_right,
                   BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query range that sees the key block [n_first, n_last]: (q_lo, full_lo, full_hi, q_hi).

    Query i sees key j iff j - diag_offset - window_right <= i <= j - diag_offset + window_left.
    The ragged last query tile is never "full" (its padded rows need the mask)."""
    q_lo = 0
    q_hi = seqlen_q
    if HAS_RIGHT:
        q_lo = tl.maximum(n_first - diag_offset - window_right, 0) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        q_hi = tl.minimum(tl.maximum(n_last - diag_offset + window_left + 1, 0), seqlen_q)
    q_hi = tl.maximum(q_hi, q_lo)
    full_lo = q_lo
    full_hi = seqlen_q // BLOCK_M * BLOCK_M
    if HAS_RIGHT:
        first_full = tl.maximum(n_last - diag_offset - window_right, 0)
        full_lo = tl.maximum(q_lo, tl.cdiv(first_full, BLOCK_M) * BLOCK_M)
    if HAS_LEFT:
        last_full = tl.maximum(n_first - diag_offset + window_left + 1, 0)
        full_hi = tl.minimum(full_hi, last_full // BLOCK_M * BLOCK_M)
    full_lo = tl.minimum(full_lo, q_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), q_hi)
    return q_lo, full_lo, full_hi, q_hi


@triton.jit
def _band_visible(offs_m, offs_n, diag_offset, window_left, window_right,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """The element mask's band test for rows offs_m[:, None] and keys offs_n[None, :]
    (pass transposed index vectors for a keys-by-rows tile)."""
    visible = offs_n >= 0
    if HAS_RIGHT:
        visible = visible & (offs_n <= offs_m + diag_offset + window_right)
    if HAS_LEFT:
        visible = visible & (offs_n >= offs_m + diag_offset - window_left)
    return visible


@triton.jit
def _softcap_tanh(qk, softcap_inv):
    """tanh(x) for x = qk * softcap_inv (= scale * qk / softcap), accurate to a few float32
    ulps relative for every x, so softcap * tanh(x) keeps the score's own precision at any
    cap.  1 - 2 / (exp(2x) + 1) cancels for small x: at softcap 1e6 a score of 1 came back
    0.1 off (issue #11).  Here |x| < 0.25 takes the odd Taylor series to x^7 (truncation
    < 4e-7 relative); larger |x| takes (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.61,
    where 1 - e no longer cancels.  Infinite x gives +-1, NaN stays NaN.  The forward's
    softmax step and the backward's derivative (1 - tanh^2) share this one function."""
    x = qk * softcap_inv
    ax = tl.abs(x)
    e = tl.math.exp2(ax * (-2.0 * 1.4426950408889634))
    small = tl.minimum(ax, 0.25)  # the series' own input, so huge |x| cannot overflow it
    x2 = small * small
    series = small * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                                                                 + x2 * -0.05396825396825397)))
    t = tl.where(ax < 0.25, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0.0, -t, t)
