"""Logical HBM traffic: exact integers derived by hand, scaling laws, tile_plan agreement."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.masking import MAX_SPLITS, split_plan, tile_plan, visible_pairs
from attnlab.model import traffic
from attnlab.shapes import LESSON_SHAPE, AttentionShape, preset

MiB = 2**20
HEAD = LESSON_SHAPE.replace(causal=False)  # N=4096, d=128, fp16, B_r=128, B_c=64
CAUSAL = LESSON_SHAPE.replace(causal=True)
ROW = 128 * 2  # bytes of one Q/K/V/O row at d=128, fp16
ACT = 4096 * ROW  # one head's Q (or K, V, O): 1,048,576 B
SCORES = 4096 * 4096 * 2  # one head's S (or P): 33,554,432 B


# ----- the lesson's four rows -------------------------------------------------------
def test_naive_three_kernels_matches_lesson_table():
    t = traffic.naive_traffic(HEAD)
    assert [k.read_bytes for k in t.kernels] == [2 * ACT, SCORES, SCORES + ACT]
    assert [k.write_bytes for k in t.kernels] == [SCORES, SCORES, ACT]
    assert t.read_bytes == 70_254_592 == 67 * MiB
    assert t.write_bytes == 68_157_440 == 65 * MiB
    assert t.total_bytes == 138_412_032 == 132 * MiB
    assert t.scope == "head" and t.condition == "unmasked"


def test_naive_four_kernels_adds_one_round_trip_of_s():
    t = traffic.naive_traffic(HEAD, kernels=4)
    assert len(t.kernels) == 4
    assert t.kernels[1].reads == (("S", SCORES),)
    assert t.kernels[1].writes == (("S (scaled)", SCORES),)
    assert t.total_bytes == 138_412_032 + 2 * SCORES == 196 * MiB


def test_fused_unmasked_matches_lesson():
    t = traffic.fused_forward_traffic(HEAD)
    (kernel,) = t.kernels
    assert dict(kernel.reads) == {"Q": ACT, "K": 32 * ACT, "V": 32 * ACT}
    assert dict(kernel.writes) == {"O": ACT}
    assert t.read_bytes == 65 * MiB and t.write_bytes == 1 * MiB
    assert t.total_bytes == 69_206_016 == 66 * MiB
    assert t.bytes_of("S") == 0 and t.bytes_of("P") == 0


def test_idealised_causal_naive_matches_lesson():
    t = traffic.naive_causal_traffic(CAUSAL)
    half = SCORES // 2  # 16 MiB per triangle
    assert t.read_bytes == 3 * ACT + 2 * half == 35 * MiB
    assert t.write_bytes == ACT + 2 * half == 33 * MiB
    assert t.total_bytes == 71_303_168 == 68 * MiB
    assert t.condition == "causal"


def test_exact_triangle_counts_the_diagonal():
    t = traffic.naive_causal_traffic(CAUSAL, triangle="exact")
    stored = 4096 * 4097 // 2 * 2  # N(N+1)/2 pairs, 2 bytes each
    assert t.bytes_of("S") == 2 * stored and t.bytes_of("P") == 2 * stored
    assert t.total_bytes == 4 * ACT + 4 * stored


def test_fused_causal_matches_lesson():
    t = traffic.fused_forward_traffic(CAUSAL)
    # query tile i (1-based) loads KV tiles 1..2i = 128 i key rows: sum = 128 * 528
    kv_rows = 128 * sum(range(1, 33))
    assert kv_rows == 67_584 == traffic.kv_rows_streamed(CAUSAL)
    assert t.bytes_of("K") == t.bytes_of("V") == kv_rows * ROW == 33 * MiB // 2
    assert t.read_bytes == 34 * MiB and t.write_bytes == 1 * MiB
    assert t.total_bytes == 36_700_160 == 35 * MiB


def test_lse_write_adds_four_bytes_per_query_row():
    base = traffic.fused_forward_traffic(HEAD)
    with_lse = traffic.fused_forward_traffic(HEAD, write_lse=True)
    assert with_lse.total_bytes - base.total_bytes == 4096 * 4 == 16_384
    assert dict(with_lse.kernels[0].writes)["LSE"] == 16_384


def test_lesson_comparison_ratios_are_matched():
    table = traffic.lesson_comparison(LESSON_SHAPE)
    assert [r.total_bytes for r in table["rows"]] == [132 * MiB, 66 * MiB, 68 * MiB, 35 * MiB]
    unmasked, causal = table["ratios"]
    assert unmasked.ratio == 2.0 and unmasked.matched
    assert causal.ratio == 68 / 35 and f"{causal.ratio:.2f}" == "1.94" and causal.matched
    assert "matched" in unmasked.label and "CROSS" not in causal.label


def test_cross_condition_ratio_refused_unless_asked_then_labelled():
    naive = traffic.naive_traffic(HEAD)
    fused_causal = traffic.fused_forward_traffic(CAUSAL)
    with pytest.raises(ValueError, match="cross_condition=True"):
        traffic.traffic_ratio(naive, fused_causal)
    cross = traffic.traffic_ratio(naive, fused_causal, cross_condition=True)
    assert not cross.matched
    assert cross.ratio == 132 / 35
    assert "CROSS-CONDITION" in cross.label


def test_ratio_refuses_different_shapes_or_scopes():
    naive = traffic.naive_traffic(HEAD)
    with pytest.raises(ValueError, match="shapes differ"):
        traffic.traffic_ratio(naive, traffic.fused_forward_traffic(HEAD.replace(seqlen_q=2048,
                                                                                 seqlen_k=2048)))
    with pytest.raises(ValueError, match="scopes differ"):
        traffic.traffic_ratio(naive, traffic.fused_forward_traffic(HEAD, scope="layer"))
    with pytest.raises(TypeError, match="Traffic record"):
        traffic.traffic_ratio(naive, 3)
    # block sizes belong to the kernel: a different B_r still compares
    assert traffic.traffic_ratio(naive, traffic.fused_forward_traffic(HEAD.replace(block_m=64)))


# ----- other shapes, derived by hand --------------------------------------------------
def test_ragged_n_unmasked_and_causal():
    shape = AttentionShape(seqlen_q=1000, seqlen_k=1000, head_dim=64, dtype="fp16")
    row = 64 * 2
    # 8 query tiles, each loads all 16 KV tiles = 1000 real rows (the last tile has 40)
    t = traffic.fused_forward_traffic(shape)
    assert t.bytes_of("K") == 8 * 1000 * row == 1_024_000
    assert t.total_bytes == 1000 * row * 2 + 2 * 8 * 1000 * row == 2_304_000
    # causal: tiles 0..6 load 128 (i + 1) rows, the ragged tile 7 loads all 1000
    causal = shape.replace(causal=True)
    assert traffic.kv_rows_streamed(causal) == 128 * 28 + 1000 == 4584
    assert traffic.fused_forward_traffic(causal).total_bytes == 2 * 4584 * row + 2 * 1000 * row
    assert len(tile_plan(causal).query_tile(7).rows) == 104  # 1000 - 7 * 128


def test_block_n_larger_than_block_m():
    shape = AttentionShape(seqlen_q=1024, seqlen_k=1024, causal=True, block_m=64, block_n=128)
    # query tile i loads KV tiles 0..ceil((i+1)/2)-1: 1,1,2,2,...,8,8 tiles of 128 rows
    assert traffic.kv_rows_streamed(shape) == 128 * 2 * sum(range(1, 9)) == 9216
    t = traffic.fused_forward_traffic(shape)
    assert t.total_bytes == 2 * 9216 * ROW + 2 * 1024 * ROW == 5_242_880
    # every query tile straddles the diagonal in exactly its last loaded tile
    for tile in tile_plan(shape).query_tiles:
        assert tile.masked == (tile.kv_stop - 1,)
    unmasked = traffic.fused_forward_traffic(shape.replace(causal=False))
    assert unmasked.total_bytes == 16 * 2 * 1024 * ROW + 2 * 1024 * ROW == 8_912_896


def test_gqa_six_to_one_packed_and_unpacked():
    shape = preset("qwen-gqa").shape(4096)  # 24 q heads, 4 kv heads, d=256, bf16, causal
    row = 256 * 2
    per_pass = 67_584 * row  # causal KV rows per head at B_r=128, B_c=64
    unpacked = traffic.fused_forward_traffic(shape, scope="layer")
    packed = traffic.fused_forward_traffic(shape, scope="layer", pack_gqa=True)
    assert unpacked.bytes_of("K") == 24 * per_pass == 830_472_192
    assert packed.bytes_of("K") == 4 * per_pass == 138_412_032
    assert packed.bytes_of("Q") == unpacked.bytes_of("Q") == 24 * 4096 * row
    assert traffic.gqa_kv_bytes(shape) == {"unpacked": 2 * 24 * per_pass,
                                           "packed": 2 * 4 * per_pass}
    group = traffic.fused_forward_traffic(shape, scope="kv-group", pack_gqa=True)
    assert group.bytes_of("K") == per_pass and group.bytes_of("Q") == 6 * 4096 * row
    with pytest.raises(ValueError, match="kv-group"):
        traffic.fused_forward_traffic(shape, scope="head", pack_gqa=True)


def test_fp32_scores_with_bf16_inputs_and_fp32_inputs():
    qwen = preset("qwen-gqa").shape(4096, causal=False)
    naive = traffic.naive_traffic(qwen, score_dtype="fp32")
    act, scores = 4096 * 256 * 2, 4096 * 4096 * 4
    assert naive.total_bytes == 4 * act + 4 * scores == 276_824_064
    fp32 = traffic.naive_traffic(HEAD.replace(dtype="fp32"))
    assert fp32.total_bytes == 2 * 138_412_032


def test_scopes_scale_exactly():
    head = traffic.fused_forward_traffic(CAUSAL)
    layer = traffic.fused_forward_traffic(CAUSAL.replace(batch=2), scope="layer")
    assert layer.total_bytes == 2 * 32 * head.total_bytes
    model = traffic.fused_forward_traffic(CAUSAL, scope="model", layers=32)
    assert model.total_bytes == 32 * 32 * head.total_bytes
    assert model.flops == 32 * 32 * head.flops
    assert model.layers == 32 and "model" in model.scope_label


# ----- Flash-Decoding and backward ------------------------------------------------------
def test_flash_decoding_counts_partials_and_combine():
    shape = AttentionShape(query_heads=32, kv_heads=8, seqlen_q=1, seqlen_k=32768, causal=True)
    t = traffic.flash_decoding_traffic(shape, num_splits=8, scope="layer")
    split, combine = t.kernels
    assert dict(split.reads) == {"Q": 32 * 8 * ROW, "K": 8 * 32768 * ROW, "V": 8 * 32768 * ROW}
    partial_o, partial_lse = 8 * 32 * 128 * 4, 8 * 32 * 4
    assert dict(split.writes) == {"O partial (fp32)": partial_o, "LSE partial (fp32)": partial_lse}
    assert dict(combine.reads) == dict(split.writes)
    assert dict(combine.writes) == {"O": 32 * ROW}
    unpacked = traffic.flash_decoding_traffic(shape, num_splits=8, scope="layer", pack_gqa=False)
    assert unpacked.bytes_of("K") == 32 * 32768 * ROW


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16])
def test_flash_decoding_reads_each_key_once_whatever_the_splits(splits):
    shape = AttentionShape(seqlen_q=1, seqlen_k=1000)  # 16 KV tiles, the last ragged
    t = traffic.flash_decoding_traffic(shape, num_splits=splits, scope="head", pack_gqa=False)
    assert t.bytes_of("K") == 1000 * ROW
    assert t.bytes_of("O partial (fp32)") == 2 * splits * 128 * 4  # written and read back
    # flash-attn's rule: ceil(16 / 3) = 6 tiles per split, the last split shorter
    assert split_plan(16, 3) == (range(0, 6), range(6, 12), range(12, 16))


def test_flash_decoding_trailing_splits_may_be_empty():
    # 16 KV tiles over 7 splits: ceil(16 / 7) = 3 tiles each, so splits 6 holds none
    assert [len(r) for r in split_plan(16, 7)] == [3, 3, 3, 3, 3, 1, 0]
    shape = AttentionShape(seqlen_q=1, seqlen_k=1000)
    t = traffic.flash_decoding_traffic(shape, num_splits=20, scope="head", pack_gqa=False)
    assert t.bytes_of("K") == 1000 * ROW  # every key once, even with more splits than tiles
    assert t.bytes_of("O partial (fp32)") == 2 * 20 * 128 * 4  # empty splits write partials


def test_backward_two_pass_by_hand():
    t = traffic.backward_traffic(CAUSAL)
    pre, dkdv, dq = t.kernels
    q_rows = 128 * sum(2 * (i + 1) for i in range(32))  # Q rows over visible tile pairs
    assert q_rows == 135_168
    assert dict(pre.reads) == {"O": ACT, "dO": ACT} and dict(pre.writes) == {"D": 4096 * 4}
    assert dict(dkdv.reads) == {"K": ACT, "V": ACT, "Q": q_rows * ROW, "dO": q_rows * ROW,
                                "LSE": q_rows * 4, "D": q_rows * 4}
    assert dict(dkdv.writes) == {"dK": ACT, "dV": ACT}
    assert dict(dq.reads) == {"Q": ACT, "dO": ACT, "LSE": 4096 * 4, "D": 4096 * 4,
                              "K": 67_584 * ROW, "V": 67_584 * ROW}
    assert dict(dq.writes) == {"dQ": ACT}
    assert t.total_bytes == 114_376_704


def test_backward_atomic_dq_reads_and_writes_the_fp32_accumulator_per_pair():
    t = traffic.backward_traffic(CAUSAL, variant="atomic-dq")
    main = t.kernels[2]
    accum = 135_168 * 128 * 4
    assert dict(main.reads)["dQ accum (fp32)"] == accum == dict(main.writes)["dQ accum (fp32)"]
    assert dict(t.kernels[3].writes) == {"dQ": ACT}


def test_backward_gqa_adds_the_group_reduction():
    shape = preset("qwen-gqa").shape(1024)
    t = traffic.backward_traffic(shape, scope="layer")
    reduce = t.kernels[-1]
    per_head = 1024 * 256 * 2
    assert dict(reduce.reads) == {"dK": 24 * per_head, "dV": 24 * per_head}
    assert dict(reduce.writes) == {"dK (summed)": 4 * per_head, "dV (summed)": 4 * per_head}


# ----- scaling and monotonicity -----------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), d=st.sampled_from([32, 64, 128, 256]),
       dtype=st.sampled_from(["fp16", "bf16", "fp32"]))
def test_naive_follows_its_closed_form(n, d, dtype):
    shape = AttentionShape(seqlen_q=n, seqlen_k=n, head_dim=d, dtype=dtype)
    b = shape.element_bytes
    assert traffic.naive_traffic(shape).total_bytes == 4 * n * d * b + 4 * n * n * b


@pytest.mark.parametrize("n", [512, 1024, 4096])
def test_naive_intermediates_grow_as_n_squared_and_ignore_d(n):
    def intermediates(seqlen, d):
        t = traffic.naive_traffic(AttentionShape(seqlen_q=seqlen, seqlen_k=seqlen, head_dim=d))
        return t.bytes_of("S") + t.bytes_of("P")
    assert intermediates(2 * n, 128) == 4 * intermediates(n, 128)
    assert intermediates(n, 64) == intermediates(n, 256)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_kv_traffic_grows_as_n_squared_d_over_block_m(causal):
    def kv(n, d, block_m):
        shape = AttentionShape(seqlen_q=n, seqlen_k=n, head_dim=d, causal=causal,
                               block_m=block_m, block_n=64)
        t = traffic.fused_forward_traffic(shape)
        return t.bytes_of("K") + t.bytes_of("V")
    base = kv(4096, 128, 128)
    assert kv(4096, 256, 128) == 2 * base
    if not causal:
        assert kv(8192, 128, 128) == 4 * base
        assert kv(4096, 128, 64) == 2 * base
    else:  # causal: T_r (T_r + 1) / 2 passes of B_r rows -> N^2/B_r to leading order
        assert kv(8192, 128, 128) == 2 * 128 * 2 * 128 * sum(range(1, 65))
        assert kv(4096, 128, 64) == 2 * 128 * 2 * 64 * sum(range(1, 65))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2000), causal=st.booleans(),
       block_m=st.sampled_from([16, 64, 128]), block_n=st.sampled_from([16, 32, 64, 128]))
def test_traffic_never_shrinks_as_n_grows(n, causal, block_m, block_n):
    def total(seqlen, fn):
        shape = AttentionShape(seqlen_q=seqlen, seqlen_k=seqlen, causal=causal,
                               block_m=block_m, block_n=block_n)
        return fn(shape).total_bytes
    assert total(n + 1, traffic.fused_forward_traffic) >= total(n, traffic.fused_forward_traffic)
    naive = (lambda s: traffic.naive_causal_traffic(s, triangle="exact")) if causal \
        else traffic.naive_traffic
    assert total(n + 1, naive) > total(n, naive)


# ----- agreement with the reference's tile plan ------------------------------------------------
shapes = st.builds(
    AttentionShape,
    seqlen_q=st.integers(1, 300), seqlen_k=st.integers(1, 300),
    head_dim=st.sampled_from([16, 64]), causal=st.booleans(),
    window=st.sampled_from([(-1, -1), (0, 0), (31, -1), (100, 7), (-1, 40), (5, 5)]),
    block_m=st.sampled_from([16, 32, 64, 128]), block_n=st.sampled_from([16, 32, 64, 128]),
)


@settings(max_examples=150, deadline=None)
@given(shape=shapes)
def test_fused_traffic_agrees_with_the_tile_plan(shape):
    plan = tile_plan(shape)
    t = traffic.fused_forward_traffic(shape)
    row = shape.head_dim * shape.element_bytes
    per_tile = [plan.loaded_kv_rows(i) for i in range(len(plan.query_tiles))]
    assert t.bytes_of("K") == sum(per_tile) * row == plan.kv_rows_loaded() * row
    assert visible_pairs(shape) == plan.visible_pairs()


def test_lesson_causal_plan_agrees_with_reference():
    plan = tile_plan(CAUSAL)
    assert sum(plan.loaded_kv_rows(i) for i in range(32)) == traffic.kv_rows_streamed(CAUSAL)
    assert list(plan.query_tile(4).masked) == [8, 9]


# ----- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("call, error, match", [
    (lambda: traffic.naive_traffic(HEAD, kernels=5), ValueError, "kernels must be 3"),
    (lambda: traffic.naive_traffic(CAUSAL), ValueError, "naive_causal_traffic"),
    (lambda: traffic.naive_traffic(HEAD, score_dtype="fp8"), ValueError, "dtype must be one of"),
    (lambda: traffic.naive_traffic(HEAD, scope="galaxy"), ValueError, "scope must be one of"),
    (lambda: traffic.naive_traffic(HEAD, layers=32), ValueError, "only to scope='model'"),
    (lambda: traffic.naive_traffic(HEAD, scope="model"), ValueError, "layers must be an int >= 1"),
    (lambda: traffic.naive_traffic(HEAD, scope="model", layers=0), ValueError, "layers"),
    (lambda: traffic.naive_traffic("shape"), TypeError, "AttentionShape"),
    (lambda: traffic.naive_causal_traffic(HEAD), ValueError, "needs a masked shape"),
    (lambda: traffic.naive_causal_traffic(CAUSAL, triangle="third"), ValueError, "triangle"),
    (lambda: traffic.naive_causal_traffic(CAUSAL.replace(seqlen_q=100)), ValueError,
     "triangle='exact'"),
    (lambda: traffic.fused_forward_traffic(HEAD, write_lse="yes"), TypeError, "write_lse"),
    (lambda: traffic.fused_forward_traffic(HEAD, pack_gqa=1), TypeError, "pack_gqa"),
    (lambda: traffic.flash_decoding_traffic(HEAD, num_splits=0), ValueError, "num_splits"),
    (lambda: traffic.flash_decoding_traffic(HEAD, num_splits=MAX_SPLITS + 1), ValueError,
     rf"\[1, {MAX_SPLITS}\]"),
    (lambda: traffic.backward_traffic(HEAD, variant="fast"), ValueError, "variant must be one of"),
    (lambda: traffic.lesson_comparison(HEAD.replace(window=(8, 0))), ValueError, "window"),
    (lambda: traffic.traffic_ratio(traffic.naive_traffic(HEAD), traffic.naive_traffic(HEAD),
                                   cross_condition="y"), TypeError, "cross_condition"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_kv_heads_must_divide_query_heads():
    with pytest.raises(ValueError, match="kv_heads must divide query_heads"):
        HEAD.replace(query_heads=32, kv_heads=5)


def test_as_dict_is_exact_integers():
    d = traffic.fused_forward_traffic(CAUSAL, write_lse=True).as_dict()
    assert d["total_bytes"] == 36_700_160 + 16_384
    assert d["kernels"][0]["writes"] == {"O": ACT, "LSE": 16_384}
    assert d["scope_label"].startswith("per head") and d["condition"] == "causal"


# ----- the byte model against the decode kernel's own buffers ------------------------------
def test_flash_decoding_partials_are_the_kernel_buffers():
    # The split kernel writes, and the combine reads, exactly the fp32 partial O and LSE
    # buffers flash_decode allocates: (batch, seqlen_q, heads, splits[, d]).
    torch = pytest.importorskip("torch")
    from attnlab.kernels.decode import flash_decode
    from attnlab.kernels.forward import kernel_is_interpreted

    if not (torch.cuda.is_available() or kernel_is_interpreted()):
        pytest.skip("the decode kernel needs a CUDA GPU or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = AttentionShape(batch=2, query_heads=4, kv_heads=2, seqlen_q=3, seqlen_k=100,
                           head_dim=32, causal=True, block_n=32)
    q = torch.randn(2, 3, 4, 32, dtype=torch.float16, device=device)
    k = torch.randn(2, 100, 2, 32, dtype=torch.float16, device=device)
    _, _, (o_part, lse_part) = flash_decode(q, k, k, scale=0.2, causal=True, num_splits=3,
                                            return_partials=True)
    model = traffic.flash_decoding_traffic(shape, num_splits=3, scope="layer")
    split, combine = model.kernels
    assert dict(split.writes) == {"O partial (fp32)": o_part.numel() * 4,
                                  "LSE partial (fp32)": lse_part.numel() * 4}
    assert dict(combine.reads) == dict(split.writes)
    assert model.bytes_of("O partial (fp32)") == 2 * o_part.numel() * 4


def test_attnlab_backward_is_two_launches_with_d_from_the_dq_pass():
    t = traffic.backward_traffic(CAUSAL, variant="attnlab")
    dq, dkdv = t.kernels
    q_rows = 135_168  # as in the two-pass layout: Q rows over visible tile pairs
    assert dict(dq.reads) == {"Q": ACT, "dO": ACT, "O": ACT, "LSE": 4096 * 4,
                              "K": 67_584 * ROW, "V": 67_584 * ROW}
    assert dict(dq.writes) == {"dQ": ACT, "D": 4096 * 4}
    assert dict(dkdv.reads) == {"K": ACT, "V": ACT, "Q": q_rows * ROW, "dO": q_rows * ROW,
                                "LSE": q_rows * 4, "D": q_rows * 4}
    assert dict(dkdv.writes) == {"dK": ACT, "dV": ACT}
    # One read of O replaces the preprocess's O and dO reads and D write and re-read.
    fa2 = traffic.backward_traffic(CAUSAL, variant="two-pass")
    assert fa2.total_bytes - t.total_bytes == ACT + 4096 * 4


def test_split_dkdv_programs_stream_the_query_rows_twice_and_form_s_twice():
    # BackwardConfig.dkdv_split: the dV program reads Q, dO, LSE; the dK program Q, dO,
    # LSE and D.  Five MMAs per tile pair instead of four.
    one = traffic.backward_traffic(CAUSAL, variant="attnlab").kernels[1]
    two = traffic.backward_traffic(CAUSAL, variant="attnlab", dkdv_split=True).kernels[1]
    q_rows = 135_168
    assert dict(two.reads) == {"K": ACT, "V": ACT, "Q": 2 * q_rows * ROW,
                               "dO": 2 * q_rows * ROW, "LSE": 2 * q_rows * 4, "D": q_rows * 4}
    assert dict(two.writes) == dict(one.writes)
    assert two.flops * 8 == one.flops * 10
    with pytest.raises(ValueError, match="dkdv_split is attnlab's"):
        traffic.backward_traffic(CAUSAL, variant="two-pass", dkdv_split=True)
    with pytest.raises(ValueError, match="dv_tiles are the Gluon kernel's"):
        traffic.backward_traffic(CAUSAL, variant="attnlab", dkdv_split=True, dv_tiles=(64, 128))


def test_the_gluon_one_gradient_launches_by_hand():
    # backward_sm90 at d = 256: the dV launch (64-row tiles: K, Q, dO, LSE -> dV, two
    # products a tile pair), then the dK launch (32-row tiles: K, V, Q, dO, LSE, D -> dK,
    # three).  SMALL causal with 128-key blocks: keys 0-127 are seen by rows 0-255, keys
    # 128-255 by rows 128-255: 384 query rows at either tile height.
    shape = SMALL.replace(causal=True)
    t = traffic.backward_traffic(shape, variant="attnlab-sm90", dq_tiles=(128, 64),
                                 dkdv_tiles=(32, 128), dkdv_split=True, dv_tiles=(64, 128))
    dq, dv, dk = t.kernels
    act, rows = 256 * SMALL_ROW, 384
    assert dict(dv.reads) == {"K": act, "Q": rows * SMALL_ROW, "dO": rows * SMALL_ROW,
                              "LSE (log2)": rows * 4}
    assert dict(dv.writes) == {"dV": act}
    assert dict(dk.reads) == {"K": act, "V": act, "Q": rows * SMALL_ROW,
                              "dO": rows * SMALL_ROW, "LSE (log2)": rows * 4, "D": rows * 4}
    assert dict(dk.writes) == {"dK": act}
    one = traffic.backward_traffic(shape, variant="attnlab-sm90", dq_tiles=(128, 64),
                                   dkdv_tiles=(32, 128)).kernels[1]
    assert dv.flops + dk.flops == one.flops * 10 // 8


def test_attnlab_backward_reads_kv_once_per_kv_head_and_adds_no_reduction():
    shape = preset("qwen-gqa").shape(1024)
    t = traffic.backward_traffic(shape, scope="layer", variant="attnlab")
    assert len(t.kernels) == 2
    per_head = 1024 * 256 * 2
    dkdv = t.kernels[1]
    assert dict(dkdv.writes) == {"dK": 4 * per_head, "dV": 4 * per_head}
    assert dict(dkdv.reads)["K"] == 4 * per_head


def test_the_sm90_dkdv_path_reads_the_lse_in_log2_units_written_by_dq():
    t = traffic.backward_traffic(CAUSAL, variant="attnlab-sm90")
    dq, dkdv = t.kernels
    assert dict(dq.writes)["LSE (log2)"] == 4096 * 4
    assert "LSE (log2)" in dict(dkdv.reads) and "LSE" not in dict(dkdv.reads)
    assert t.total_bytes - traffic.backward_traffic(CAUSAL, variant="attnlab").total_bytes == \
        4096 * 4


# ----- an fp8 (e4m3) KV cache ---------------------------------------------------------------
def test_fp8_cache_decode_bytes_by_hand():
    # 16 sequences x 32k keys, 8 KV heads of d = 128, 32 query heads, one query, 1 split.
    shape = AttentionShape(batch=16, query_heads=32, kv_heads=8, seqlen_q=1, seqlen_k=32768,
                           head_dim=128, dtype="bf16", causal=True)
    bf16 = traffic.flash_decoding_traffic(shape, num_splits=1)
    fp8 = traffic.flash_decoding_traffic(shape, num_splits=1, kv_dtype="float8_e4m3fn")
    per_operand = 16 * 8 * 32768 * 128  # elements of K (and of V), each row read once
    assert bf16.bytes_of("K") == bf16.bytes_of("V") == 2 * per_operand
    assert fp8.bytes_of("K") == fp8.bytes_of("V") == per_operand  # 1 byte each
    assert fp8.bytes_of("Q") == bf16.bytes_of("Q") == 16 * 32 * 128 * 2  # q stays bf16
    # One k and one v descale (4 bytes each) per split program: 16 x 8 programs.
    assert fp8.bytes_of("K/V descales (fp32)") == 16 * 8 * 2 * 4
    assert bf16.bytes_of("K/V descales (fp32)") == 0
    assert fp8.total_bytes == bf16.total_bytes - 2 * per_operand + 16 * 8 * 8
    assert "fp8" in fp8.label
    with pytest.raises(ValueError, match="kv_dtype must be fp16, bf16, fp32, fp64 or fp8"):
        traffic.flash_decoding_traffic(shape, num_splits=1, kv_dtype="e5m2")


# ----- attnlab's backward with each kernel's own tiles, counted by hand -----------------------
SMALL = AttentionShape(seqlen_q=256, seqlen_k=256, head_dim=64, dtype="fp16")
SMALL_ROW = 64 * 2  # bytes of one fp16 row of 64


def test_attnlab_backward_counts_each_kernels_tiles_unmasked():
    # dQ 128 x 64: 2 query tiles each load all 4 key tiles (2 x 256 K rows, as many V).
    # dK/dV 64 rows x 128 keys: 2 key blocks each load all 4 query tiles (2 x 256 rows).
    t = traffic.backward_traffic(SMALL, variant="attnlab", dq_tiles=(128, 64),
                                 dkdv_tiles=(64, 128))
    dq, dkdv = t.kernels
    act, stats = 256 * SMALL_ROW, 256 * 4
    assert dict(dq.reads) == {"Q": act, "dO": act, "O": act, "LSE": stats,
                              "K": 512 * SMALL_ROW, "V": 512 * SMALL_ROW}
    assert dict(dq.writes) == {"dQ": act, "D": stats}
    assert dict(dkdv.reads) == {"K": act, "V": act, "Q": 512 * SMALL_ROW,
                                "dO": 512 * SMALL_ROW, "LSE": 512 * 4, "D": 512 * 4}
    assert dict(dkdv.writes) == {"dK": act, "dV": act}


def test_attnlab_backward_counts_each_kernels_tiles_causal():
    # dQ 128 x 64: rows 0-127 see keys 0-127 (2 key tiles), rows 128-255 all 4: 384 rows.
    # dK/dV 64 x 128: keys 0-127 are seen by rows 0-255 (4 query tiles), keys 128-255
    # by rows 128-255 (2): 384 query rows.  Swapping the tiles changes both counts:
    # dQ 64 x 128 loads 128 + 128 + 256 + 256 = 768 key rows.
    t = traffic.backward_traffic(SMALL.replace(causal=True), variant="attnlab-sm90",
                                 dq_tiles=(128, 64), dkdv_tiles=(64, 128))
    dq, dkdv = t.kernels
    assert dict(dq.reads)["K"] == 384 * SMALL_ROW
    assert dict(dkdv.reads)["Q"] == 384 * SMALL_ROW
    assert dict(dkdv.reads)["LSE (log2)"] == 384 * 4
    swapped = traffic.backward_traffic(SMALL.replace(causal=True), variant="attnlab",
                                       dq_tiles=(64, 128), dkdv_tiles=(128, 64))
    assert dict(swapped.kernels[0].reads)["K"] == 768 * SMALL_ROW


def test_attnlab_backward_gqa_reads_kv_once_and_each_query_heads_rows():
    # 2 query heads on 1 KV head: dK/dV reads K, V once and both heads' Q, dO; dQ (one
    # program per query head) reads K, V for each head.
    shape = SMALL.replace(query_heads=2, kv_heads=1)
    t = traffic.backward_traffic(shape, variant="attnlab", scope="layer", dq_tiles=(128, 64),
                                 dkdv_tiles=(64, 128))
    dq, dkdv = t.kernels
    assert dict(dkdv.reads)["K"] == 256 * SMALL_ROW
    assert dict(dkdv.reads)["Q"] == 2 * 512 * SMALL_ROW
    assert dict(dq.reads)["K"] == 2 * 512 * SMALL_ROW
    assert dict(dkdv.writes) == {"dK": 256 * SMALL_ROW, "dV": 256 * SMALL_ROW}


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"variant": "two-pass", "dq_tiles": (64, 64)}, "attnlab's kernels' tiles"),
    ({"variant": "attnlab", "dq_tiles": (64,)}, "query rows, key rows"),
    ({"variant": "attnlab", "dkdv_tiles": (0, 64)}, "dkdv_tiles"),
])
def test_backward_tiles_are_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        traffic.backward_traffic(SMALL, **kwargs)
