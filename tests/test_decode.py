"""Flash-Decoding and the KV-cache API against the float64 reference.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1) with small
caches and 32-key tiles, so a few hundred keys already span many tiles and splits;
the GPU tests at the bottom repeat the invariants at real sizes (128k keys, batch 64,
CUDA-graph capture).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attention_inputs import paged_copy
from attnlab.accuracy import check_accuracy
from attnlab.kernels.configs import decode_config
from attnlab.kernels.decode import flash_decode, launch_plan
from attnlab.kernels.dispatch import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    choose_num_splits,
    wave_efficiency,
)
from attnlab.kernels.forward import kernel_is_interpreted
from attnlab.reference import merge_states as reference_merge_states
from attnlab.reference import split_kv
from attnlab.reference.decode import apply_rotary, kvcache_attention

on_gpu = torch.cuda.is_available()
runs_kernels = pytest.mark.skipif(
    not on_gpu and not kernel_is_interpreted(),
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (the README's test command)")
gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU")
DEVICE = "cuda" if on_gpu else "cpu"
BLOCK_N = decode_config(64, interpreted=kernel_is_interpreted()).block_n


def randn(*shape, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(DEVICE)


def to_bhsd(t):
    return t.transpose(1, 2)


def check_dense(out, lse, q, k, v, **options):
    """The accuracy rule on a dense (bshd) q, k, v; returns the check."""
    result = check_accuracy(out, lse, q, k, v, layout="bshd", **options)
    assert result.passed, result
    return result


# ----- the split-count policy (pure arithmetic) -------------------------------------------
def test_wave_arithmetic_examples_in_the_docstring():
    h200 = dict(sm_count=132, ctas_per_sm=1, block_n=128)  # the tuned d = 128 tiling
    assert choose_num_splits(batch=1, kv_heads=8, row_blocks=1, kv_tiles=256, **h200) == 14
    assert choose_num_splits(batch=16, kv_heads=8, row_blocks=1, kv_tiles=256, **h200) == 1
    assert choose_num_splits(batch=64, kv_heads=8, row_blocks=1, kv_tiles=1024, **h200) == 1
    two_per_sm = dict(sm_count=132, ctas_per_sm=2, block_n=64)  # twice the splits
    assert choose_num_splits(batch=1, kv_heads=8, row_blocks=1, kv_tiles=512, **two_per_sm) == 29
    assert choose_num_splits(batch=16, kv_heads=8, row_blocks=1, kv_tiles=512, **two_per_sm) == 2
    # Short caches: no split under MIN_KEYS_PER_SPLIT keys.  d = 256's 32-key tiles at 1 x
    # 4k / 8k (4 KV heads) measured best at 16-32 splits; 64 (of 64 keys) was slower.
    d256 = dict(sm_count=132, ctas_per_sm=2, block_n=32)
    assert choose_num_splits(batch=1, kv_heads=4, row_blocks=1, kv_tiles=128, **d256) == 15
    assert choose_num_splits(batch=1, kv_heads=4, row_blocks=1, kv_tiles=256, **d256) == 29
    assert wave_efficiency(224, 264) == pytest.approx(224 / 264)
    assert wave_efficiency(300, 264) == pytest.approx(300 / 528)


@pytest.mark.parametrize("batch", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("kv_tiles", [1, 2, 3, 63, 2048])
def test_split_count_is_bounded_and_never_leaves_empty_splits(batch, kv_tiles):
    splits = choose_num_splits(batch=batch, kv_heads=8, row_blocks=1, kv_tiles=kv_tiles,
                               sm_count=132, ctas_per_sm=2, block_n=64)
    assert 1 <= splits <= MAX_SPLITS
    assert splits == 1 or kv_tiles * 64 // splits >= MIN_KEYS_PER_SPLIT
    per_split = -(-kv_tiles // splits)
    assert (splits - 1) * per_split < kv_tiles  # the last split has a tile


def test_launch_plan_counts_programs_against_sms():
    plan = launch_plan(batch=1, kv_heads=8, query_heads=32, seqlen_q=1, seqlen_k=32768,
                       head_dim=128, sm_count=132)
    assert plan["num_splits"] == 14 and plan["programs"] == 8 * 14
    assert plan["block_m"] == 16  # 4 query heads packed, padded to tl.dot's 16 rows


def test_routing_policy():
    from attnlab.kernels.dispatch import routes_to_decode

    assert routes_to_decode(seqlen_q=1, seqlen_k=4096, needs_grad=False)
    assert not routes_to_decode(seqlen_q=1, seqlen_k=4096, needs_grad=True)
    assert not routes_to_decode(seqlen_q=1024, seqlen_k=1024, needs_grad=False)
    assert not routes_to_decode(seqlen_q=64, seqlen_k=200, needs_grad=False)


# ----- kernel == reference ------------------------------------------------------------------
@runs_kernels
@pytest.mark.parametrize(("seqlen_q", "options"), [
    (1, {}), (1, {"causal": True}), (5, {"causal": True}), (3, {"window": (40, 0)}),
    (2, {"softcap": 4.0}), (9, {"causal": True, "window": (50, -1)}),
])
def test_decode_equals_last_rows_of_prefill(seqlen_q, options):
    # The prefill over the whole sequence, then its last rows: what a decode step computes.
    batch, heads, kv_heads, dim, total = 2, 8, 2, 64, 200
    q_all = randn(batch, total, heads, dim, seed=1)
    k, v = randn(batch, total, kv_heads, dim, seed=2), randn(batch, total, kv_heads, dim, seed=3)
    scale = 1 / math.sqrt(dim)
    out, lse = flash_decode(q_all[:, -seqlen_q:], k, v, scale=scale, **options)
    prefill, prefill_lse = attnlab.flash_attn_func(
        q_all.double().cpu(), k.double().cpu(), v.double().cpu(), softmax_scale=scale,
        causal=options.get("causal", False), window_size=options.get("window", (-1, -1)),
        softcap=options.get("softcap", 0.0), return_attn_probs=True, impl="reference")[:2]
    check_dense(out, lse, q_all[:, -seqlen_q:], k, v, scale=scale, **options)
    torch.testing.assert_close(out.double().cpu(), prefill[:, -seqlen_q:], atol=3e-3, rtol=0)
    torch.testing.assert_close(lse.double().cpu(), prefill_lse[:, :, -seqlen_q:].double(),
                               atol=1e-4, rtol=0)


@runs_kernels
@pytest.mark.parametrize("num_splits", [1, 2, 3, 17, 133])
def test_k_splits_equal_one_split_and_the_reference_split_by_split(num_splits):
    # 239 keys: 8 tiles of 32 on the CPU, so 17 and 133 splits leave most splits empty
    # (and 133 takes the combine's LSE pass three steps).
    heads, kv_heads, dim, seqlen_k = 4, 1, 32, 239
    q, k, v = randn(1, 2, heads, dim, seed=4), randn(1, seqlen_k, kv_heads, dim, seed=5), \
        randn(1, seqlen_k, kv_heads, dim, seed=6)
    scale = 1 / math.sqrt(dim)
    out, lse, (o_part, lse_part) = flash_decode(q, k, v, scale=scale, causal=True,
                                                num_splits=num_splits, return_partials=True)
    one, one_lse = flash_decode(q, k, v, scale=scale, causal=True, num_splits=1)
    states = split_kv(*(to_bhsd(t).double().cpu() for t in (q, k, v)), num_splits=num_splits,
                      causal=True, scale=scale, block_n=BLOCK_N)
    for split, state in enumerate(states):
        got_o = o_part[:, :, :, split].permute(0, 2, 1, 3).double().cpu()
        got_lse = lse_part[:, :, :, split].transpose(1, 2).double().cpu()
        assert torch.equal(torch.isneginf(got_lse), torch.isneginf(state.lse)), split
        if not state.kv_tiles:
            assert torch.all(got_o == 0) and torch.isneginf(got_lse).all()
        torch.testing.assert_close(got_o, state.out, atol=2e-3, rtol=0)
        finite = torch.isfinite(state.lse)
        torch.testing.assert_close(got_lse[finite], state.lse[finite], atol=1e-4, rtol=0)
    check_dense(out, lse, q, k, v, scale=scale, causal=True)
    torch.testing.assert_close(out.float(), one.float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, one_lse, atol=1e-5, rtol=0)


@runs_kernels
def test_a_call_without_the_lse_writes_the_same_output():
    """The LSE is neither allocated nor written unless asked for (the decode API's
    ``return_softmax_lse``), with one split or several; the output is the same."""
    q, k, v = randn(2, 3, 8, 32, seed=7), randn(2, 239, 2, 32, seed=8), \
        randn(2, 239, 2, 32, seed=9)
    for num_splits in (1, 5):
        out, lse = flash_decode(q, k, v, scale=0.2, causal=True, num_splits=num_splits)
        no_lse, none = flash_decode(q, k, v, scale=0.2, causal=True, num_splits=num_splits,
                                    write_lse=False)
        assert none is None and torch.equal(no_lse, out)
        check_dense(out, lse, q, k, v, scale=0.2, causal=True)


@runs_kernels
@pytest.mark.parametrize("page_size", [16, 48, 64])
def test_paged_cache_equals_contiguous(page_size):
    # 48 = one and a half 32-key tiles: tiles cross pages.  64: two tiles per page.
    batch, heads, kv_heads, dim, capacity = 2, 4, 2, 32, 150
    q = randn(batch, 1, heads, dim, seed=7)
    k_cache, v_cache = randn(batch, capacity, kv_heads, dim, seed=8), \
        randn(batch, capacity, kv_heads, dim, seed=9)
    lengths = torch.tensor([150, 97], dtype=torch.int32, device=DEVICE)
    k_pages, block_table = paged_copy(k_cache, page_size, seed=1)
    v_pages, _ = paged_copy(v_cache, page_size, seed=1)
    options = dict(cache_seqlens=lengths, causal=True, num_splits=3)
    contiguous, c_lse = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True,
                                                        impl="triton", **options)
    paged, p_lse = attnlab.flash_attn_with_kvcache(q, k_pages, v_pages, block_table=block_table,
                                                   return_softmax_lse=True, impl="triton", **options)
    assert attnlab.last_impl() == "triton-decode"
    assert torch.equal(contiguous, paged) and torch.equal(c_lse, p_lse)
    for b, length in enumerate(lengths.tolist()):
        check_dense(paged[b:b + 1], p_lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :length],
                    v_cache[b:b + 1, :length], causal=True)


@runs_kernels
@pytest.mark.parametrize("page_size", [16, 32, 48, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_caches_give_contiguous_bits_and_flag_a_bad_entry(page_size, causal):
    """A paged cache (one scalar base per tile inside a page, the table read once per tile
    across pages, per-key where a page does not divide the tile: 48) gives the contiguous
    cache's bits, and still flags a bad entry."""
    batch, heads, kv_heads, dim, capacity = 3, 4, 2, 32, 200
    q = randn(batch, 2, heads, dim, seed=50)
    k_cache, v_cache = randn(batch, capacity, kv_heads, dim, seed=51), \
        randn(batch, capacity, kv_heads, dim, seed=52)
    lengths = torch.tensor([200, 97, 33], dtype=torch.int32, device=DEVICE)
    (k_pages, table), (v_pages, _) = (paged_copy(c, page_size, seed=6) for c in (k_cache, v_cache))
    options = dict(scale=0.2, causal=causal, cache_seqlens=lengths, num_splits=3)
    contiguous = flash_decode(q, k_cache, v_cache, **options)
    paged = flash_decode(q, k_pages, v_pages, block_table=table, **options)
    assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])
    table[1, 1] = k_pages.shape[0]  # a page sequence 1 (97 keys) uses at every size
    out, _ = flash_decode(q, k_pages, v_pages, block_table=table, **options)
    assert torch.isnan(out[1]).all() and torch.equal(out[0], contiguous[0][0])
    with pytest.raises(ValueError, match=rf"block_table\[1, 1\] = {k_pages.shape[0]}"):
        attnlab.check_kvcache_indices(DEVICE)


def test_paged_caches_keep_as_many_tiles_in_flight_as_contiguous_ones(json_from_fresh_python):
    # Compiled here for sm_90a (the H200's d = 128 tiling): with the table read in the same
    # step as the K/V tiles it addresses, Triton 3.6's pipeliner awaited every copy before
    # the MMAs (depths 0) where the contiguous cache keeps two tiles in flight (2).
    depths = json_from_fresh_python(
        "import json; from attnlab.kernels import decode, _aot; "
        "from attnlab.kernels.configs import decode_config; out = {}\n"
        "for page in (0, 16, 256):\n"
        "    kernel = decode.compile_for_sm90(128, decode_config(128), page_size=page)\n"
        "    out[page] = max(_aot.async_copy_depths(kernel.asm['ttgir']))\n"
        "print(json.dumps(out))")
    contiguous = depths.pop("0")
    assert contiguous == decode_config(128).num_stages - 1
    assert depths == dict.fromkeys(depths, contiguous)


@runs_kernels
@pytest.mark.parametrize("paged", [False, True])
def test_append_then_attend_writes_exactly_the_new_rows(paged):
    batch, heads, kv_heads, dim, capacity, seqlen_new = 3, 4, 2, 32, 96, 3
    q = randn(batch, seqlen_new, heads, dim, seed=10)
    k_new, v_new = randn(batch, seqlen_new, kv_heads, dim, seed=11), \
        randn(batch, seqlen_new, kv_heads, dim, seed=12)
    k_cache, v_cache = randn(batch, capacity, kv_heads, dim, seed=13), \
        randn(batch, capacity, kv_heads, dim, seed=14)
    lengths = torch.tensor([0, 40, 93], dtype=torch.int32, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths.tolist()):
        expected_k[b, n:n + seqlen_new] = k_new[b]
        expected_v[b, n:n + seqlen_new] = v_new[b]
    extra = {}
    if paged:
        k_cache, block_table = paged_copy(k_cache, 32, seed=2)
        v_cache, _ = paged_copy(v_cache, 32, seed=2)
        untouched_k, untouched_v = paged_copy(expected_k, 32, seed=2)[0], paged_copy(expected_v, 32, seed=2)[0]
        extra["block_table"] = block_table
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                               cache_seqlens=lengths, causal=True,
                                               return_softmax_lse=True, impl="triton", **extra)
    if paged:
        # Pages the table does not use keep their bytes; used pages hold the expected rows.
        used = extra["block_table"].flatten().long()
        spare = torch.ones(k_cache.shape[0], dtype=torch.bool, device=DEVICE)
        spare[used] = False
        assert torch.equal(k_cache[spare], before_k[spare]) and torch.equal(v_cache[spare], before_v[spare])
        assert torch.equal(k_cache[used], untouched_k[used]) and torch.equal(v_cache[used], untouched_v[used])
    else:
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    for b, n in enumerate(lengths.tolist()):
        end = n + seqlen_new
        check_dense(out[b:b + 1], lse[b:b + 1], q[b:b + 1], expected_k[b:b + 1, :end],
                    expected_v[b:b + 1, :end], causal=True)


def rotate_by_hand(x, cos, sin, positions, interleaved):
    """Rotary embedding element by element in float64 (the definition, no vector tricks)."""
    x = x.double().cpu()
    out = x.clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            p = int(positions[b, s])
            for i in range(half):
                c, n = float(cos[p, i]), float(sin[p, i])
                a, z = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                out[b, s, :, a] = x[b, s, :, a] * c - x[b, s, :, z] * n
                out[b, s, :, z] = x[b, s, :, a] * n + x[b, s, :, z] * c
    return out


@runs_kernels
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_equals_rotary_by_hand(interleaved, causal):
    batch, heads, kv_heads, dim, capacity, rotary_dim = 2, 2, 1, 48, 64, 32
    seqlen_q = seqlen_new = 2
    angle = torch.rand(capacity, rotary_dim // 2, generator=torch.Generator().manual_seed(3)) * 6.3
    cos, sin = torch.cos(angle).to(DEVICE), torch.sin(angle).to(DEVICE)
    q = randn(batch, seqlen_q, heads, dim, seed=15)
    k_new, v_new = randn(batch, seqlen_new, kv_heads, dim, seed=16), \
        randn(batch, seqlen_new, kv_heads, dim, seed=17)
    k_cache, v_cache = randn(batch, capacity, kv_heads, dim, seed=18), \
        randn(batch, capacity, kv_heads, dim, seed=19)
    lengths = torch.tensor([5, 50], dtype=torch.int32, device=DEVICE)
    k_positions = lengths.long()[:, None].cpu() + torch.arange(seqlen_new)
    q_positions = lengths.long()[:, None].cpu() + (torch.arange(seqlen_q) if causal else 0)
    q_q = rotate_by_hand(q, cos.cpu(), sin.cpu(), q_positions.expand(batch, seqlen_q), interleaved)
    k_k = rotate_by_hand(k_new, cos.cpu(), sin.cpu(), k_positions, interleaved)
    got_q = apply_rotary(q.double(), cos, sin, q_positions.expand(batch, seqlen_q).to(DEVICE),
                         interleaved=interleaved)
    torch.testing.assert_close(got_q.cpu(), q_q, atol=1e-12, rtol=0)

    hand_k_cache, hand_v_cache = k_cache.clone(), v_cache.clone()
    out = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                          rotary_sin=sin, cache_seqlens=lengths, causal=causal,
                                          rotary_interleaved=interleaved, impl="triton")
    for b, n in enumerate(lengths.tolist()):
        # The cache holds the rotated new keys (rounded once to fp16), values unrotated.
        torch.testing.assert_close(k_cache[b, n:n + seqlen_new].double().cpu(), k_k[b],
                                   atol=2e-3, rtol=0)
        assert torch.equal(v_cache[b, n:n + seqlen_new], v_new[b])
        hand_k_cache[b, n:n + seqlen_new] = k_cache[b, n:n + seqlen_new]
        hand_v_cache[b, n:n + seqlen_new] = v_new[b]
        expected, _ = kvcache_attention(q_q[b:b + 1].to(q.dtype).to(DEVICE), hand_k_cache[b:b + 1],
                                        hand_v_cache[b:b + 1], cache_seqlens=n + seqlen_new,
                                        causal=causal)
        torch.testing.assert_close(out[b:b + 1].float(), expected.float(), atol=4e-3, rtol=0)


@runs_kernels
def test_leftpad_and_batch_idx_equal_the_unpadded_call():
    heads, kv_heads, dim, capacity = 4, 2, 32, 120
    q = randn(2, 2, heads, dim, seed=20)
    pool_k, pool_v = randn(4, capacity, kv_heads, dim, seed=21), randn(4, capacity, kv_heads, dim, seed=22)
    batch_idx = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([10, 0], dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([110, 77], dtype=torch.int32, device=DEVICE)
    out, lse = attnlab.flash_attn_with_kvcache(
        q, pool_k, pool_v, cache_seqlens=lengths, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
        causal=True, return_softmax_lse=True, num_splits=2, impl="triton")
    for b, (row, first, end) in enumerate(zip(batch_idx.tolist(), leftpad.tolist(), lengths.tolist(),
                                              strict=True)):
        k, v = pool_k[row:row + 1, first:end].contiguous(), pool_v[row:row + 1, first:end].contiguous()
        alone, alone_lse = attnlab.flash_attn_with_kvcache(
            q[b:b + 1], k, v, causal=True, return_softmax_lse=True, num_splits=2, impl="triton")
        torch.testing.assert_close(out[b:b + 1], alone, atol=1e-3, rtol=0)
        torch.testing.assert_close(lse[b:b + 1], alone_lse, atol=1e-5, rtol=0)
        check_dense(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v, causal=True)


@runs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "seqlen_q"), [(2, 2, 3), (8, 2, 2), (8, 1, 1), (32, 1, 3)])
def test_gqa_ratios(heads, kv_heads, seqlen_q):
    # Ratio 32 with 3 queries packs 96 rows: two 64-row blocks per KV head.
    dim, seqlen_k = 32, 130
    q, k, v = randn(1, seqlen_q, heads, dim, seed=23), randn(1, seqlen_k, kv_heads, dim, seed=24), \
        randn(1, seqlen_k, kv_heads, dim, seed=25)
    out, lse = flash_decode(q, k, v, scale=0.2, causal=True, num_splits=2)
    check_dense(out, lse, q, k, v, scale=0.2, causal=True)


@runs_kernels
@pytest.mark.parametrize("seqlen_k", [1, 239, 4097])
def test_cache_lengths(seqlen_k):
    dim = 64
    q = randn(1, 1, 4, dim, dtype=torch.bfloat16, seed=seqlen_k)
    k, v = randn(1, seqlen_k, 1, dim, dtype=torch.bfloat16, seed=1), \
        randn(1, seqlen_k, 1, dim, dtype=torch.bfloat16, seed=2)
    out, lse = attnlab.flash_attn_with_kvcache(q, k, v, causal=True, return_softmax_lse=True,
                                               impl="triton")
    check_dense(out, lse, q, k, v, causal=True)


@runs_kernels
def test_empty_sequences_give_zero_and_minus_inf():
    q = randn(2, 1, 2, 32, seed=26)
    k_cache, v_cache = randn(2, 64, 1, 32, seed=27), randn(2, 64, 1, 32, seed=28)
    lengths = torch.tensor([0, 64], dtype=torch.int32, device=DEVICE)
    out, lse = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                               return_softmax_lse=True, num_splits=4, impl="triton")
    assert torch.all(out[0] == 0) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all() and not torch.isnan(out).any()


@runs_kernels
def test_attention_routes_decode_shapes_to_the_split_kernel():
    q, k, v = randn(2, 4, 1, 64, seed=29), randn(2, 2, 300, 64, seed=30), randn(2, 2, 300, 64, seed=31)
    out, lse = attnlab.attention(q, k, v, enable_gqa=True, causal=True, return_lse=True, impl="triton")
    assert attnlab.last_impl() == "triton-decode"
    assert check_accuracy(out, lse, q, k, v, causal=True).passed


@runs_kernels
def test_reference_impl_matches_the_kernel():
    q = randn(2, 2, 4, 32, seed=32)
    k_cache, v_cache = randn(2, 80, 2, 32, seed=33), randn(2, 80, 2, 32, seed=34)
    k_new, v_new = randn(2, 2, 2, 32, seed=35), randn(2, 2, 2, 32, seed=36)
    lengths = torch.tensor([7, 70], dtype=torch.int32, device=DEVICE)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    outs = [attnlab.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lengths,
                                            causal=True, impl=impl)
            for (kc, vc), impl in zip(caches, ("triton", "reference"), strict=True)]
    assert attnlab.last_impl() == "reference"
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=0)


# ----- index tensors: checked on the device, never read on the host --------------------------
def _serving_call(paged: bool, append: bool, rotary: bool, extra: dict | None = None):
    """A decode step as a server makes it: tensor cache_seqlens, maybe pages, append, rotary."""
    batch, heads, kv_heads, dim, capacity = 3, 8, 2, 64, 96
    q = randn(batch, 1, heads, dim, seed=40)
    k_cache, v_cache = randn(batch, capacity, kv_heads, dim, seed=41), \
        randn(batch, capacity, kv_heads, dim, seed=42)
    options = dict(cache_seqlens=torch.tensor([5, 90, 0], dtype=torch.int32, device=DEVICE),
                   causal=True, return_softmax_lse=True, impl="triton", **(extra or {}))
    if paged:
        (k_cache, table), (v_cache, _) = (paged_copy(c, 16, seed=3) for c in (k_cache, v_cache))
        options["block_table"] = table
    if append:
        options.update(k=randn(batch, 1, kv_heads, dim, seed=43),
                       v=randn(batch, 1, kv_heads, dim, seed=44))
    if rotary:
        angle = torch.rand(capacity, 16, generator=torch.Generator().manual_seed(5)) * 6.3
        options.update(rotary_cos=angle.cos().to(DEVICE), rotary_sin=angle.sin().to(DEVICE))
    return q, k_cache, v_cache, options


@runs_kernels
@pytest.mark.parametrize(("paged", "append", "rotary"), [
    (False, False, False), (True, False, False), (False, True, True), (True, True, True)])
def test_a_call_reads_no_tensor_value_on_the_host(no_value_reads, paged, append, rotary):
    """The first call (validation and planning) and a repeated one: no .item(), .tolist(),
    .cpu(), ... anywhere on the path; the launches are the append (when k, v are
    given), the split kernel and the combine."""
    q, k_cache, v_cache, options = _serving_call(paged, append, rotary)
    for _ in range(2):
        with no_value_reads() as launched:
            attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=3, **options)
        assert launched == ["_rotary_append"] * append + ["_split_kv_decode", "_combine_partials"]
        launched.clear()


def test_the_value_guard_can_fail(no_value_reads):
    """The guard above catches a host read: the reference path reads cache_seqlens."""
    q, k_cache, v_cache, options = _serving_call(False, False, False)
    with pytest.raises(AssertionError, match="read a tensor's values"), no_value_reads():
        attnlab.flash_attn_with_kvcache(q.cpu(), k_cache.cpu(), v_cache.cpu(),
                                        **dict(options, impl="reference",
                                               cache_seqlens=options["cache_seqlens"].cpu()))


BAD_INDICES = [  # (case, paged, append, the index change, the words of the record)
    ("cache_seqlens past the capacity", False, False,
     lambda o: o["cache_seqlens"].copy_(torch.tensor([5, 97, 0])), r"cache_seqlens\[1\] = 97"),
    ("negative cache_seqlens", True, False,
     lambda o: o["cache_seqlens"].copy_(torch.tensor([5, -2, 0])), r"cache_seqlens\[1\] = -2"),
    ("append past the capacity", False, True,
     lambda o: o["cache_seqlens"].copy_(torch.tensor([5, 96, 0])), r"cache_seqlens\[1\] = 96"),
    ("a page outside the pool", True, False,
     lambda o: o["block_table"].__setitem__((1, 2), 1000), r"block_table\[1, 2\] = 1000"),
    ("an append into a page outside the pool", True, True,
     lambda o: o["block_table"].__setitem__((1, 5), -7), r"block_table\[1, 5\] = -7"),
    ("leftpad past cache_seqlens", False, False,
     lambda o: o.update(cache_leftpad=torch.tensor([0, 91, 0], dtype=torch.int32, device=DEVICE)),
     r"cache_leftpad\[1\] = 91"),
    ("a cache row outside the cache", False, True,
     lambda o: o.update(cache_batch_idx=torch.tensor([0, 3, 2], dtype=torch.int32, device=DEVICE)),
     r"cache_batch_idx\[1\] = 3"),
]


@runs_kernels
@pytest.mark.parametrize(("case", "paged", "append", "change", "words"), BAD_INDICES,
                         ids=[c[0] for c in BAD_INDICES])
def test_a_bad_index_is_flagged_on_the_device_and_its_sequence_is_nan(case, paged, append,
                                                                      change, words):
    """Sequence 1's index is bad: its output and LSE are NaN, nothing of it is written,
    the other sequences are right, and check_kvcache_indices raises naming it (once:
    the record is cleared)."""
    q, k_cache, v_cache, options = _serving_call(paged, append, False)
    attnlab.check_kvcache_indices(DEVICE)  # a clean record to start from
    good_k, good_v = k_cache.clone(), v_cache.clone()
    expected = attnlab.flash_attn_with_kvcache(q, good_k, good_v, num_splits=2, **options)
    change(options)
    before_k = k_cache.clone()
    out, lse = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=2, **options)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    for b in (0, 2):
        assert torch.equal(out[b], expected[0][b]) and torch.equal(lse[b], expected[1][b])
    if append:  # sequence 1 wrote nothing; the others wrote what they write anyway
        written = k_cache != before_k
        assert torch.equal(k_cache[written], good_k[written])
    with pytest.raises(ValueError, match=words):
        attnlab.check_kvcache_indices(DEVICE)
    attnlab.check_kvcache_indices(DEVICE)  # cleared


@runs_kernels
def test_a_repeated_page_inside_one_sequence_is_a_shared_slot():
    """Sequence 0 appends 17 keys from position 0 and its table names one page for
    columns 0 and 1: positions 0 and 16 meet in one slot."""
    q, k_cache, v_cache, options = _serving_call(True, False, False)
    options["block_table"][0, 1] = options["block_table"][0, 0]
    options["cache_seqlens"].copy_(torch.tensor([0, 60, 0]))
    out, _ = attnlab.flash_attn_with_kvcache(
        q, k_cache, v_cache, randn(3, 17, 2, 64, seed=47), randn(3, 17, 2, 64, seed=48),
        **options)
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1:]).any()
    with pytest.raises(ValueError, match="block_table makes sequence 0 .a repeated page. twice"):
        attnlab.check_kvcache_indices(DEVICE)


SM90_BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attnlab.kernels.append import _rotary_append
from attnlab.kernels.decode import _combine_partials, _split_kv_decode
from attnlab.kernels.forward import _attn_fwd
TYPES = dict(O_PART="*fp32", LSE_OUT="*fp32", ERRORS="*i64", COS="*fp32",
             SIN="*fp32", CACHE_SEQLENS="*i32", CACHE_BATCH_IDX="*i32", CACHE_LEFTPAD="*i32",
             BLOCK_TABLE="*i32", ROTARY_SEQLENS="*i32", LSE="*fp32", CU_SEQLENS_Q="*i32",
             CU_SEQLENS_K="*i32", SEQUSED_K="*i32", K_DESCALE="*fp32", V_DESCALE="*fp32",
             Q_DESCALE="*fp32")
FP8_CACHE = dict(K="*fp8e4nv", V="*fp8e4nv", K_CACHE="*fp8e4nv", V_CACHE="*fp8e4nv")
def build(kernel, constants, warps, stages, types=()):
    types = dict(TYPES, **dict(types))
    signature = {n: "constexpr" if n in constants else types.get(n, "*bf16") if n.isupper()
                 else "fp32" if n in ("qk_scale", "softcap_log2", "softcap_inv") else "i32"
                 for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n.isupper() and n not in constants}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    return bool(compiled.asm["cubin"])
built = []
for page, d, block_n, batch_idx, per_page, fp8 in (
        (0, 128, 128, False, False, False), (256, 256, 64, False, True, False),
        (0, 64, 64, True, False, False),
        (16, 128, 128, False, True, False), (256, 128, 128, False, True, False),
        (16, 128, 128, False, True, True)):
    built.append(build(_split_kv_decode, dict(
        HEAD_DIM=d, HEAD_DIM_PAD=d, BLOCK_M=16, BLOCK_N=block_n, PAGE_SIZE=page,
        HAS_SEQLENS=True, HAS_BATCH_IDX=batch_idx, HAS_LEFTPAD=batch_idx, HAS_LEFT=False,
        HAS_RIGHT=True, HAS_SOFTCAP=False, WRITE_PARTIAL=True, UPCAST_DOT=False,
        PER_PAGE=per_page, DESCALED=fp8, ROW_SCALED_Q=fp8, WRITE_LSE=not fp8), 4, 3,
        FP8_CACHE if fp8 else ()))
built.append(build(_combine_partials, dict(HEAD_DIM=128, HEAD_DIM_PAD=128, LSE_CHUNK=64,
                                           O_CHUNK=32, WRITE_LSE=True), 2, 1))
for page, half, batch_idx, fp8 in ((0, 32, False, False), (16, 64, False, False),
                                   (0, 0, True, False), (16, 64, False, True)):
    built.append(build(_rotary_append, dict(
        HEAD_DIM=128, HEAD_DIM_PAD=128, ROTARY_HALF=half, HALF_PAD=max(half, 1),
        INTERLEAVED=True, ROTATE_Q=half > 0, Q_SAME_POSITION=False, PAGE_SIZE=page,
        HAS_SEQLENS=True, HAS_BATCH_IDX=batch_idx, HAS_LEFTPAD=False, HAS_ROTARY_SEQLENS=False,
        CHECK_SHARED=page > 0 or batch_idx, BLOCK_B=64, QUANTISE=fp8, EMULATE_FP8=False), 1, 1,
        dict(K_CACHE="*fp8e4nv", V_CACHE="*fp8e4nv") if fp8 else ()))
for page, seqused, varlen in ((16, True, True),):
    built.append(build(_attn_fwd, dict(
        HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_M=128, BLOCK_N=64, HAS_LEFT=False, HAS_RIGHT=True,
        HAS_SOFTCAP=False, REVERSE_M=True, UPCAST_DOT=False, IS_VARLEN=varlen,
        OFFSETS_64=False, PAGE_SIZE=page, HAS_SEQUSED=seqused, FP8=False, EMULATE_FP8=False),
        8, 2))
print(json.dumps(built))
"""


@pytest.mark.slow
def test_the_serving_kernels_build_for_sm90(json_from_fresh_python):
    """The interpreter runs what ptxas may refuse (loop-carried flags, scalar atomics):
    the split, combine and append kernels and the paged varlen forward compile for
    sm_90a here, without a GPU (an fp8 cache's split and append kernels too)."""
    assert json_from_fresh_python(SM90_BUILD) == [True] * 12


# ----- merge_state / merge_states ----------------------------------------------------------
def test_merge_states_is_exact_and_drops_empty_partials():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 10, generator=gen, dtype=torch.float64)
    values = torch.randn(10, 4, generator=gen, dtype=torch.float64)

    def attend(cols):
        s = scores[:, cols]
        return torch.softmax(s, -1) @ values[cols], torch.logsumexp(s, -1)

    whole = attend(slice(0, 10))
    parts = [attend(slice(0, 3)), attend(slice(3, 7)), attend(slice(7, 10))]
    # Stacked along dim 1, FlashInfer's layout: v (rows, states, dim), s (rows, states).
    out, lse = attnlab.merge_states(torch.stack([p[0] for p in parts], dim=1),
                                    torch.stack([p[1] for p in parts], dim=1))
    torch.testing.assert_close(out, whole[0]) and torch.testing.assert_close(lse, whole[1])
    empty_o, empty_lse = torch.full((3, 4), float("nan"), dtype=torch.float64), \
        torch.full((3,), float("-inf"), dtype=torch.float64)
    out2, lse2 = attnlab.merge_state(whole[0], whole[1], empty_o, empty_lse)
    torch.testing.assert_close(out2, whole[0]) and torch.testing.assert_close(lse2, whole[1])
    none_o, none_lse = attnlab.merge_state(empty_o.float(), empty_lse.float(), empty_o.float(),
                                           empty_lse.float())
    assert torch.all(none_o == 0) and torch.isneginf(none_lse).all()
    # fp16 partials are merged in fp32 and returned in fp16, LSE in fp32.
    half, half_lse = attnlab.merge_state(whole[0].half(), whole[1].half(), whole[0].half(), whole[1].half())
    assert half.dtype == torch.float16 and half_lse.dtype == torch.float32
    torch.testing.assert_close(half_lse, whole[1].float() + math.log(2), atol=2e-3, rtol=0)
    # The public merge is the reference's formula.
    ref_out, ref_lse = reference_merge_states(*parts[0], *parts[1])
    pub_out, pub_lse = attnlab.merge_state(*parts[0], *parts[1])
    assert torch.equal(ref_out, pub_out) and torch.equal(ref_lse, pub_lse)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=runs_kernels)])
def test_flash_attn_func_chains_into_merge_state_as_the_readme_shows(impl):
    q, k, v = randn(2, 5, 4, 32, seed=1), randn(2, 70, 2, 32, seed=2), randn(2, 70, 2, 32, seed=3)
    if impl == "reference":
        q, k, v = q.cpu(), k.cpu(), v.cpu()
    k_a, v_a, k_b, v_b = k[:, :45], v[:, :45], k[:, 45:], v[:, 45:]
    # The README's lines, as written:
    out_a, lse_a, _ = attnlab.flash_attn_func(q, k_a, v_a, return_attn_probs=True, impl=impl)
    out_b, lse_b, _ = attnlab.flash_attn_func(q, k_b, v_b, return_attn_probs=True, impl=impl)
    out, lse = attnlab.merge_state(out_a, lse_a, out_b, lse_b)  # = attention over k_a, k_b
    assert out.dtype == q.dtype and lse.shape == lse_a.shape == (2, 4, 5)
    check_dense(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu())
    whole, whole_lse, _ = attnlab.flash_attn_func(q, k, v, return_attn_probs=True, impl=impl)
    assert torch.allclose(lse, whole_lse, atol=1e-5)
    # Chains: the merged LSE has the layout it came in.
    again, _ = attnlab.merge_state(out, lse, out_a, torch.full_like(lse_a, float("-inf")))
    assert torch.equal(again, out)


def test_merge_states_takes_flashinfers_stacked_layout():
    """v (seq_len, num_states, heads, dim), s (seq_len, num_states, heads), natural log."""
    q, k, v = randn(1, 6, 4, 16, seed=4).cpu(), randn(1, 60, 4, 16, seed=5).cpu(), \
        randn(1, 60, 4, 16, seed=6).cpu()
    segments = [slice(0, 7), slice(7, 40), slice(40, 60)]
    states = [attnlab.flash_attn_func(q, k[:, s], v[:, s], return_attn_probs=True)[:2]
              for s in segments]
    v_stacked = torch.stack([out[0] for out, _ in states], dim=1)        # (6, 3, 4, 16)
    s_stacked = torch.stack([lse[0].T for _, lse in states], dim=1)      # (6, 3, 4)
    out, lse = attnlab.merge_states(v_stacked, s_stacked)
    whole, whole_lse, _ = attnlab.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == (6, 4, 16) and lse.shape == (6, 4)
    assert torch.allclose(lse, whole_lse[0].T, atol=1e-5)
    assert (out.float() - whole[0].float()).abs().max() < 2e-3
    # The two-state call on FlashInfer's 3-D layout agrees with the stacked one.
    two, two_lse = attnlab.merge_state(v_stacked[:, 0], s_stacked[:, 0], v_stacked[:, 1],
                                       s_stacked[:, 1])
    stacked_two = attnlab.merge_states(v_stacked[:, :2], s_stacked[:, :2])
    assert torch.equal(two, stacked_two[0]) and torch.equal(two_lse, stacked_two[1])


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda o, l: attnlab.merge_states(o, l), ValueError, "num_states"),
    (lambda o, l: attnlab.merge_states(o[:, None], l[:, None].expand(2, 2)), ValueError, "v.shape"),
    (lambda o, l: attnlab.merge_state(o, l, o, l[:1]), ValueError, "states must match"),
    (lambda o, l: attnlab.merge_state(o, l, o.int(), l), TypeError, "v_b"),
    (lambda o, l: attnlab.merge_state(o, l, o, [0.0, 0.0]), TypeError, "s_b"),
    (lambda o, l: attnlab.merge_state(o[None, None], l[None, None], o[None, None],
                                      l[None, None]), ValueError, "s_a must be"),
])
def test_merge_states_rejects_bad_inputs(call, error, match):
    o, lse = torch.zeros(2, 4), torch.zeros(2)
    with pytest.raises(error, match=match):
        call(o, lse)


# ----- bad inputs raise before any kernel runs ----------------------------------------------------
def _inputs():
    q = torch.zeros(2, 1, 4, 32, dtype=torch.float16)
    cache = torch.zeros(2, 64, 2, 32, dtype=torch.float16)
    return q, cache, cache.clone()


def _bad_calls():
    lengths = torch.tensor([3, 70], dtype=torch.int32)
    negative = torch.tensor([-1, 3], dtype=torch.int32)
    pages = torch.zeros(8, 16, 2, 32, dtype=torch.float16)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 9]], dtype=torch.int32)
    f = attnlab.flash_attn_with_kvcache
    cos = torch.ones(64, 8)
    return [
        ("seqlens beyond capacity", lambda q, kc, vc: f(q, kc, vc, cache_seqlens=lengths),
         ValueError, r"cache_seqlens\[1\] = 70"),
        ("negative seqlens", lambda q, kc, vc: f(q, kc, vc, cache_seqlens=negative),
         ValueError, r"cache_seqlens\[0\] = -1"),
        ("int seqlens beyond capacity", lambda q, kc, vc: f(q, kc, vc, cache_seqlens=65),
         ValueError, "cache_seqlens"),
        ("seqlens int64", lambda q, kc, vc: f(q, kc, vc, cache_seqlens=lengths.long()),
         TypeError, "cache_seqlens must have dtype torch.int32"),
        ("block table out of range", lambda q, kc, vc: f(q, pages, pages, block_table=table),
         ValueError, r"block_table\[1, 3\] = 9"),
        ("page size", lambda q, kc, vc: f(q, pages[:, :8], pages[:, :8], block_table=table),
         ValueError, "multiple of 16"),
        ("cache dtype", lambda q, kc, vc: f(q, kc.float(), vc.float()), TypeError,
         "k_cache.dtype must equal q.dtype"),
        ("cache dims", lambda q, kc, vc: f(q, kc[0], vc[0]), ValueError, "k_cache must be 4-D"),
        ("q dims", lambda q, kc, vc: f(q[0], kc, vc), ValueError, "q must be 4-D"),
        ("alibi", lambda q, kc, vc: f(q, kc, vc, alibi_slopes=torch.ones(4)), NotImplementedError,
         "alibi_slopes"),
        ("rotary dim", lambda q, kc, vc: f(q, kc, vc, q[:, :1, :2], q[:, :1, :2], rotary_cos=cos[:, :4],
                                             rotary_sin=cos[:, :4], cache_seqlens=1),
         ValueError, "multiple of 16"),
        ("rotary without k", lambda q, kc, vc: f(q, kc, vc, rotary_cos=cos, rotary_sin=cos,
                                                   cache_seqlens=1), ValueError, "need the new k"),
        ("rotary too short", lambda q, kc, vc: f(q, kc, vc, kc[:, :1], vc[:, :1], rotary_cos=cos[:10],
                                                   rotary_sin=cos[:10], cache_seqlens=1),
         ValueError, "seqlen_ro"),
        ("rotary shapes", lambda q, kc, vc: f(q, kc, vc, kc[:, :1], vc[:, :1], rotary_cos=cos,
                                                rotary_sin=cos[:, :4], cache_seqlens=1),
         ValueError, "rotary_cos and rotary_sin"),
        ("k without v", lambda q, kc, vc: f(q, kc, vc, kc[:, :1], cache_seqlens=1), ValueError,
         "k and v"),
        ("k without seqlens", lambda q, kc, vc: f(q, kc, vc, kc[:, :1], vc[:, :1]), ValueError,
         "cache_seqlens must be given"),
        ("append past capacity", lambda q, kc, vc: f(q, kc, vc, kc[:, :2], vc[:, :2], cache_seqlens=63),
         ValueError, "capacity"),
        ("leftpad beyond seqlens", lambda q, kc, vc: f(
            q, kc, vc, cache_seqlens=lengths.clamp(max=10),
            cache_leftpad=torch.tensor([2, 11], dtype=torch.int32)), ValueError, r"cache_leftpad\[1\]"),
        ("batch idx range", lambda q, kc, vc: f(q, kc, vc, cache_batch_idx=torch.tensor(
            [0, 2], dtype=torch.int32)), ValueError, r"cache_batch_idx\[1\] = 2"),
        ("num splits", lambda q, kc, vc: f(q, kc, vc, num_splits=-1), ValueError, "num_splits"),
        ("heads", lambda q, kc, vc: f(q[:, :, :3], kc, vc), ValueError, "must divide"),
        ("window", lambda q, kc, vc: f(q, kc, vc, window_size=(1,)), TypeError, "window_size"),
        ("paged with batch idx", lambda q, kc, vc: f(q, pages, pages, block_table=table[:, :2],
                                                       cache_batch_idx=lengths), NotImplementedError,
         "cache_batch_idx"),
        ("paged with leftpad", lambda q, kc, vc: f(q, pages, pages, block_table=table[:, :2],
                                                    cache_leftpad=lengths), NotImplementedError,
         "cache_leftpad"),
    ]


@pytest.mark.parametrize(("case", "call", "error", "match"), _bad_calls(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_clear_errors(case, call, error, match):
    q, k_cache, v_cache = _inputs()
    before = k_cache.clone()
    with pytest.raises(error, match=match):
        call(q, k_cache, v_cache)
    assert torch.equal(k_cache, before)  # nothing was appended


@pytest.mark.parametrize(("option", "good", "bad"), [
    ("causal", True, 1), ("rotary_interleaved", False, 0), ("return_softmax_lse", True, 1),
    ("num_splits", 1, True), ("softmax_scale", 1.0, True), ("softcap", 0.0, False),
    ("window_size", (0, -1), (False, -1))])
def test_a_kept_plan_never_answers_an_option_of_the_wrong_type(option, good, bad):
    # True == 1 == 1.0 in Python: a call whose option only equals a planned call's must
    # still meet the check that refuses its type, not reuse that call's plan.
    q, k_cache, v_cache = _inputs()
    attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, **{option: good})
    with pytest.raises(TypeError, match=option):
        attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, **{option: bad})


def test_an_int_where_an_index_tensor_belongs_is_refused_on_every_call():
    # The plan key admits an int in any slot (cache_seqlens takes one); anywhere else the
    # plan's checks refuse it, so no plan is ever kept to skip them the second time.
    q, k_cache, v_cache = _inputs()
    for _ in range(2):
        with pytest.raises(TypeError, match="cache_batch_idx"):
            attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3,
                                             cache_batch_idx=1)


def _retyped_q(q, k_cache, v_cache, lengths):
    q.data = q.data.float()  # .data = changes no version counter


def _retyped_lengths(q, k_cache, v_cache, lengths):
    lengths.data = lengths.data.long()


def _resized_q(q, k_cache, v_cache, lengths):
    q.resize_(q.shape[0], q.shape[2], q.shape[3])


def _restrided_cache(q, k_cache, v_cache, lengths):
    # Same sizes and memory, head_dim no longer unit-stride: the kernels cannot update it.
    k_cache.as_strided_(k_cache.shape, (k_cache.stride(0), k_cache.stride(1), 1,
                                        k_cache.shape[2]))


@runs_kernels
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize(("change", "error", "match", "impls"), [
    (_retyped_q, TypeError, "k_cache.dtype must equal q.dtype", ("triton", "reference")),
    (_retyped_lengths, TypeError, "cache_seqlens must have dtype torch.int32",
     ("triton", "reference")),
    (_resized_q, ValueError, "q must be 4-D", ("triton", "reference")),
    (_restrided_cache, ValueError, "unit stride along head_dim", ("triton",)),
])
def test_a_tensor_changed_in_place_meets_the_checks_again(impl, change, error, match, impls):
    # The same tensor objects, changed in place between two calls (.data =, resize_,
    # as_strided_): the plan key reads every tensor's dtype, sizes, strides, device and
    # alignment on every call, so the call is a new signature and refused, never answered
    # by the plan the unchanged objects found (nor by the last plan found, PlanCache.find).
    if impl not in impls:
        pytest.skip(f"{impl} accepts this form")
    q, k_cache, v_cache = _inputs()
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    for _ in range(2):  # planned, then found
        attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, impl=impl)
    change(q, k_cache, v_cache, lengths)
    with pytest.raises(error, match=match):
        attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, impl=impl)


@runs_kernels
def test_a_cache_restrided_in_place_is_read_through_its_new_strides():
    # as_strided_ keeps the object and its memory; only the strides say where each key
    # is.  A plan kept for the old strides would read other keys: the result must be the
    # one a fresh contiguous copy of the restrided cache gives.
    q = randn(2, 1, 4, 32, seed=20)
    k_cache, v_cache = randn(2, 64, 2, 32, seed=21), randn(2, 64, 2, 32, seed=22)
    lengths = torch.tensor([40, 64], dtype=torch.int32)

    def call(k):
        return attnlab.flash_attn_with_kvcache(q, k, v_cache, cache_seqlens=lengths,
                                               impl="triton")

    call(k_cache), call(k_cache)
    # The memory read as (batch, kv_heads, seqlen, d): the same sizes, other keys.
    k_cache.as_strided_(k_cache.shape, (64 * 2 * 32, 32, 64 * 32, 1))
    torch.testing.assert_close(call(k_cache), call(k_cache.contiguous()), atol=0, rtol=0)


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=runs_kernels), "reference"])
def test_the_last_plan_found_answers_only_its_own_signature(impl):
    # PlanCache.find compares a key with the last one found before the dict: two
    # signatures called in turn must each get their own plan (causal or not over 3 queries).
    q = randn(2, 3, 4, 32, seed=23)
    k_cache, v_cache = randn(2, 64, 2, 32, seed=24), randn(2, 64, 2, 32, seed=25)
    lengths = torch.tensor([40, 64], dtype=torch.int32)
    outs = [attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                            causal=causal, impl=impl)
            for causal in (True, False, True, False)]
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert not torch.equal(outs[0], outs[1])


# ----- GPU: real sizes, CUDA graphs ----------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("batch", "seqlen_k"), [(1, 131072), (4, 32768), (64, 4096)])
def test_gpu_real_sizes_against_the_reference(batch, seqlen_k):
    heads, kv_heads, dim = 32, 8, 128
    q = randn(batch, 1, heads, dim, dtype=torch.bfloat16, seed=1)
    k = randn(batch, seqlen_k, kv_heads, dim, dtype=torch.bfloat16, seed=2)
    v = randn(batch, seqlen_k, kv_heads, dim, dtype=torch.bfloat16, seed=3)
    out, lse = attnlab.flash_attn_with_kvcache(q, k, v, causal=True, return_softmax_lse=True)
    rows = range(batch) if batch <= 4 else (0, batch - 1)
    for b in rows:  # the float64 oracle on the CPU, one sequence at a time
        assert check_accuracy(out[b:b + 1].cpu(), lse[b:b + 1].cpu(), q[b:b + 1].cpu(),
                              k[b:b + 1].cpu(), v[b:b + 1].cpu(), causal=True, layout="bshd").passed


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("page_size", [16, 256])
def test_gpu_paged_equals_contiguous_and_splits_agree(page_size):
    batch, heads, kv_heads, dim, capacity = 8, 32, 8, 128, 8192
    q = randn(batch, 4, heads, dim, dtype=torch.bfloat16, seed=4)
    k_cache = randn(batch, capacity, kv_heads, dim, dtype=torch.bfloat16, seed=5)
    v_cache = randn(batch, capacity, kv_heads, dim, dtype=torch.bfloat16, seed=6)
    lengths = torch.randint(1, capacity, (batch,), generator=torch.Generator().manual_seed(0),
                            dtype=torch.int32).to(DEVICE)
    k_pages, table = paged_copy(k_cache, page_size)
    v_pages, _ = paged_copy(v_cache, page_size)
    results = []
    for splits in (1, 7, 0):
        results.append(attnlab.flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table,
                                                       cache_seqlens=lengths, causal=True,
                                                       num_splits=splits, return_softmax_lse=True))
    contiguous = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                 causal=True, num_splits=0, return_softmax_lse=True)
    assert torch.equal(contiguous[0], results[2][0])
    for out, lse in results[:2]:
        torch.testing.assert_close(out.float(), results[2][0].float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(lse, results[2][1], atol=1e-4, rtol=0)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture_appends_and_attends(captured_replay):
    batch, heads, kv_heads, dim, capacity = 4, 32, 8, 128, 4096
    q = randn(batch, 1, heads, dim, dtype=torch.bfloat16, seed=7)
    k_new, v_new = randn(batch, 1, kv_heads, dim, dtype=torch.bfloat16, seed=8), \
        randn(batch, 1, kv_heads, dim, dtype=torch.bfloat16, seed=9)
    k_cache = randn(batch, capacity, kv_heads, dim, dtype=torch.bfloat16, seed=10)
    v_cache = randn(batch, capacity, kv_heads, dim, dtype=torch.bfloat16, seed=11)
    lengths = torch.tensor([100, 2000, 4000, 1], dtype=torch.int32, device=DEVICE)
    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    eager = attnlab.flash_attn_with_kvcache(q, k_eager, v_eager, k_new, v_new, cache_seqlens=lengths,
                                            causal=True, max_seqlen_k=capacity)

    def step():
        return attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                               cache_seqlens=lengths, causal=True, max_seqlen_k=capacity)

    captured = captured_replay(step)  # the warm-up writes the same rows the graph will
    assert torch.equal(captured, eager)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_a_serving_step_makes_no_device_to_host_sync(paged):
    """torch's sync detector ("error": any synchronising call raises) around warm calls
    with tensor cache_seqlens, append, rotary and (paged) a block table."""
    q, k_cache, v_cache, options = _serving_call(paged, True, True)
    options["cache_seqlens"].copy_(torch.tensor([5, 80, 0]))
    attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, **options)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, **options)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    attnlab.check_kvcache_indices()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_the_whole_call_replays_in_a_cuda_graph_with_changing_lengths(paged):
    """Rotary, append, attention and combine captured once; replayed with new lengths
    (and a new page order) written into the same index tensors, each replay equal to the
    eager call on a copy of the cache, and a bad length flagged from inside the graph."""
    batch, heads, kv_heads, dim, capacity = 4, 32, 8, 128, 4096
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rand(*shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k_new, v_new = rand(batch, 1, heads, dim), rand(batch, 1, kv_heads, dim), \
        rand(batch, 1, kv_heads, dim)
    k_cache, v_cache = rand(batch, capacity, kv_heads, dim), rand(batch, capacity, kv_heads, dim)
    angle = torch.rand(capacity, 64, device="cuda") * 6.3
    lengths = torch.tensor([100, 2000, 4000, 1], dtype=torch.int32, device="cuda")
    extra = {}
    if paged:
        (k_cache, table), (v_cache, _) = (paged_copy(c, 256, seed=4) for c in (k_cache, v_cache))
        extra["block_table"] = table
    options = dict(rotary_cos=angle.cos(), rotary_sin=angle.sin(), cache_seqlens=lengths,
                   causal=True, max_seqlen_k=capacity, return_softmax_lse=True, **extra)

    def step(kc, vc):
        return attnlab.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, **options)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(k_cache.clone(), v_cache.clone())  # warm-up: compiles, makes the error record
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(k_cache, v_cache)
    for new_lengths in ([100, 2000, 4000, 1], [7, 4095, 0, 3000], [4095, 1, 1, 1]):
        lengths.copy_(torch.tensor(new_lengths))
        if paged:
            extra["block_table"].copy_(extra["block_table"].flip(0))
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        eager = step(k_eager, v_eager)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
        assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
    attnlab.check_kvcache_indices()
    lengths.copy_(torch.tensor([5, 4096, 5, 5]))  # 4096 + 1 new key > capacity
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(captured[0][1]).all() and not torch.isnan(captured[0][0]).any()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 4096"):
        attnlab.check_kvcache_indices()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_caches_past_2_31_elements(paged):
    # 3 sequences x 700k positions x 8 KV heads x 128 = 2.15e9 elements per cache (4.3 GB
    # in bf16): the last sequence's rows (contiguous) or the pool's last pages (paged,
    # which the block table hands to sequence 0) sit past 2^31 elements.
    batch, heads, kv_heads, dim, capacity, page_size = 3, 32, 8, 128, 700_000, 256
    needed = 4 * batch * capacity * kv_heads * dim * 2 + (6 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < needed:
        pytest.skip(f"needs about {needed / 2**30:.0f} GiB of free GPU memory, "
                    f"{free / 2**30:.0f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(23)

    def rand(*shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q = rand(batch, 1, heads, dim)
    lengths = torch.tensor([capacity, 1234, capacity - 77], dtype=torch.int32, device="cuda")
    per_seq = -(-capacity // page_size)
    if paged:
        k_cache, v_cache = rand(batch * per_seq, page_size, kv_heads, dim), \
            rand(batch * per_seq, page_size, kv_heads, dim)
        # Reversed: sequence 0 reads the pool's last pages, past 2^31 elements.
        table = torch.arange(batch * per_seq - 1, -1, -1, dtype=torch.int32,
                             device="cuda").view(batch, per_seq)
        assert k_cache.numel() > 2**31
        out, lse = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table,
                                                   cache_seqlens=lengths, causal=True,
                                                   return_softmax_lse=True)
    else:
        k_cache, v_cache = rand(batch, capacity, kv_heads, dim), rand(batch, capacity, kv_heads, dim)
        assert k_cache.numel() > 2**31
        out, lse = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                   causal=True, return_softmax_lse=True)
    for b in range(batch):  # the float64 oracle, one sequence at a time
        n = int(lengths[b])
        if paged:
            rows = table[b].long()
            k = k_cache[rows].reshape(1, -1, kv_heads, dim)[:, :n]
            v = v_cache[rows].reshape(1, -1, kv_heads, dim)[:, :n]
        else:
            k, v = k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
        result = check_accuracy(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v, causal=True,
                                layout="bshd")
        assert result.passed, (b, result)
