"""FlashAttention-4 and FlashInfer as providers: their reasons, their argument mapping (on
stand-in modules that compute real attention and record their calls), the kernel-name
proof, FlashInfer's prebuild; and, on a GPU with the packages, each one against float64."""

from __future__ import annotations

import glob
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from attnlab.measure import peer_jit
from attnlab.measure import providers as prov
from attnlab.measure.providers import PROVIDERS, prepare, provider, unproven_kernels
from attnlab.measure.sweep import check_output, phase_shape
from attnlab.reference import naive
from attnlab.shapes import AttentionShape

ROOT = Path(__file__).resolve().parents[1]
SHAPE = AttentionShape(batch=2, query_heads=6, kv_heads=2, seqlen_q=48, seqlen_k=48,
                       head_dim=64, dtype="fp32", causal=True)
HALF = SHAPE.replace(dtype="bf16")
PEERS = ("fa4", "fa4_paged16", "flashinfer", "flashinfer_paged16", "attnlab_decode_paged16")


def absent(monkeypatch, *modules):
    """Make ``import module`` fail here as it does on a machine without the package."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


# ----- the reasons, in words, when the packages are absent --------------------------------------
def test_the_registry_lists_the_peers_with_their_phases_and_kernels():
    assert PROVIDERS["fa4"].phases == ("prefill", "decode", "fwdbwd")
    assert PROVIDERS["flashinfer"].phases == ("prefill", "decode")
    for name in ("fa4_paged16", "flashinfer_paged16", "attnlab_decode_paged16"):
        assert PROVIDERS[name].phases == ("decode",)
    for name in PEERS:
        p = PROVIDERS[name]
        assert p.needs_cuda and p.kernels and p.input_layout == p.output_layout == "bshd"


def test_absent_packages_are_named(monkeypatch):
    absent(monkeypatch, "flash_attn", "flash_attn.cute", "flashinfer")
    assert prov._check_fa4(HALF, "prefill").startswith(
        "flash_attn.cute is not importable (ModuleNotFoundError")
    assert prov._check_flashinfer(HALF, "decode").startswith(
        "flashinfer is not importable (ModuleNotFoundError")
    assert prov._check_flash_attn(HALF, "prefill").startswith("flash_attn is not importable")
    decode = phase_shape(HALF, "decode", 64)
    assert prov._check_fa4_paged(decode, "decode").startswith("flash_attn.cute is not importable")
    assert prov._check_flashinfer_paged(decode, "decode").startswith("flashinfer is not importable")
    # and on this machine, through the provider's own reason (the device first)
    assert provider("fa4").reason(HALF, "prefill", "cpu") == "fa4 needs a CUDA GPU"


def test_paged_providers_say_what_they_take(monkeypatch):
    absent(monkeypatch, "flash_attn.cute", "flashinfer")
    assert prov._check_fa4_paged(HALF, "prefill") == "the paged providers run decode only, not prefill"
    odd = phase_shape(HALF, "decode", 100)
    for check in (prov._check_fa4_paged, prov._check_flashinfer_paged,
                  prov._check_attnlab_decode_paged):
        assert check(odd, "decode") == ("a 16-token paged cache needs seqlen_k divisible by 16, "
                                        "got 100")
    assert provider("flashinfer_paged16").reason(HALF, "prefill", "cpu") == (
        "flashinfer_paged16 has no prefill path (phases: decode)")


def test_a_cutlass_dsl_installed_with_target_is_explained(monkeypatch, tmp_path):
    """pip --target skips the DSL wheel's .pth file: the reason says which folder to add."""
    (tmp_path / "nvidia_cutlass_dsl" / "dsl_packages").mkdir(parents=True)
    (tmp_path / "nvidia_cutlass_dsl" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("import cutlass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.cute", "nvidia_cutlass_dsl"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    absent(monkeypatch, "cutlass")
    reason = prov._check_fa4(HALF, "prefill")
    assert "nvidia-cutlass-dsl is installed but its .pth file was not read" in reason
    assert str(tmp_path / "nvidia_cutlass_dsl" / "dsl_packages") in reason


def test_flash_attn_2_is_not_mistaken_for_fa4s_namespace(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert prov._check_flash_attn(HALF, "prefill").startswith(
        "flash_attn has no flash_attn_func (flash-attn 2 is not installed")


def test_dtype_head_dim_window_and_gpu_reasons(monkeypatch):
    fake_fa4(monkeypatch)
    fake_flashinfer(monkeypatch)
    assert prov._check_fa4(SHAPE, "prefill") == "FlashAttention-4 takes fp16 or bf16, not fp32"
    assert prov._check_flashinfer(SHAPE, "prefill") == "FlashInfer takes fp16 or bf16, not fp32"
    assert prov._check_flashinfer(HALF.replace(head_dim=96), "prefill") == (
        "the FlashInfer kernels here take head_dim 64, 128, 256, got 96")
    assert prov._check_flashinfer(HALF.replace(causal=False, window=(8, 8)), "prefill") == (
        "FlashInfer takes a left window only (window_left); window=(8, 8) without causal needs "
        "a right bound")
    monkeypatch.setattr(prov, "_flashinfer_toolchain_reason", lambda: None)
    assert prov._check_flashinfer(HALF.replace(window=(8, 0)), "prefill") is None
    for arch, dim, reason in [
            ((8, 0), 64, "FlashAttention-4's kernels here are the Hopper and Blackwell ones "
                         "(sm_90, sm_100); this GPU is sm_80"),
            ((9, 0), 512, "FlashAttention-4 on sm_90 takes head_dim 8..256 in steps of 8, got 512"),
            ((10, 0), 192, "FlashAttention-4 on sm_100 takes head_dim 8..128 in steps of 8 or 256, "
                           "got 192"),
            ((9, 0), 256, None), ((10, 0), 256, None), ((10, 0), 128, None)]:
        monkeypatch.setattr(prov, "_gpu_arch", lambda arch=arch: arch)
        assert prov._check_fa4(HALF.replace(head_dim=dim), "prefill") == reason


def test_flashinfer_says_when_its_compiler_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("FLASHINFER_NVCC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(prov.shutil, "which", lambda name: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert prov._flashinfer_toolchain_reason() == (
        f"FlashInfer JIT-compiles its kernels and needs nvcc ({tmp_path}/bin/nvcc) and ninja on "
        f"PATH and a host compiler (c++) (or the flashinfer-jit-cache wheel)")


# ----- the argument mapping, on stand-ins that compute attention and record their calls -----------
def bshd_attention(q, k, v, *, causal, scale, window=(-1, -1)):
    """(B, Nq, H, d) attention of (B, Nk, Hkv, d) keys: attnlab's float reference."""
    out = naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                scale=scale, window=window)
    return out.transpose(1, 2)


def fake_fa4(monkeypatch) -> list:
    calls = []

    def window_of(size):
        return tuple(-1 if side is None else side for side in size)

    def flash_attn_func(q, k, v, *, softmax_scale, causal, window_size):
        calls.append(("func", q.shape, k.shape, softmax_scale, causal, window_size))
        return bshd_attention(q, k, v, causal=causal, scale=softmax_scale,
                              window=window_of(window_size)), None

    def flash_attn_varlen_func(q, k, v, *, page_table, seqused_k, softmax_scale, causal,
                               window_size):
        calls.append(("varlen", q.shape, k.shape, page_table.clone(), seqused_k.clone(),
                      k.data_ptr()))
        cache_k = k[page_table.long()].flatten(1, 2)  # (B, pages * 16, Hkv, d)
        cache_v = v[page_table.long()].flatten(1, 2)
        return bshd_attention(q, cache_k[:, :int(seqused_k.max())], cache_v[:, :int(seqused_k.max())],
                              causal=causal, scale=softmax_scale,
                              window=window_of(window_size)), None

    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    package.__path__, package.cute = [], cute
    cute.flash_attn_func, cute.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return calls


def nhd_attention(q, k, v, *, causal, scale, window_left=-1):
    """FlashInfer's NHD: (Nq, H, d) against (Nk, Hkv, d)."""
    return bshd_attention(q[None], k[None], v[None], causal=causal, scale=scale,
                          window=(window_left, -1))[0]


def fake_flashinfer(monkeypatch) -> list:
    calls = []
    module = types.ModuleType("flashinfer")

    def single_prefill_with_kv_cache(q, k, v, *, causal, sm_scale, window_left):
        calls.append(("single_prefill", q.shape, causal, sm_scale, window_left))
        return nhd_attention(q, k, v, causal=causal, scale=sm_scale, window_left=window_left)

    def single_decode_with_kv_cache(q, k, v, *, use_tensor_cores, sm_scale, window_left):
        calls.append(("single_decode", q.shape, use_tensor_cores, sm_scale, window_left))
        return nhd_attention(q[None], k, v, causal=True, scale=sm_scale,
                             window_left=window_left)[0]

    class Ragged:
        def __init__(self, workspace, layout, *, backend):
            calls.append(("ragged", layout, backend, workspace.numel()))

        def plan(self, qo_indptr, kv_indptr, heads, kv_heads, dim, *, causal, window_left,
                 sm_scale, q_data_type):
            self.plan_args = (qo_indptr.tolist(), kv_indptr.tolist(), causal, window_left,
                              sm_scale)
            calls.append(("ragged.plan", heads, kv_heads, dim, *self.plan_args, q_data_type))

        def run(self, q, k, v):
            qo, kv, causal, window_left, scale = self.plan_args
            return torch.cat([nhd_attention(q[qo[b]:qo[b + 1]], k[kv[b]:kv[b + 1]],
                                            v[kv[b]:kv[b + 1]], causal=causal, scale=scale,
                                            window_left=window_left)
                              for b in range(len(qo) - 1)])

    class Paged:
        def __init__(self, workspace, layout, *, use_tensor_cores, backend):
            calls.append(("paged", layout, use_tensor_cores, backend))

        def plan(self, indptr, indices, last_page_len, heads, kv_heads, dim, page_size, *,
                 window_left, sm_scale, q_data_type):
            self.args = (indptr.tolist(), indices.tolist(), last_page_len.tolist(), page_size,
                         window_left, sm_scale)
            calls.append(("paged.plan", heads, kv_heads, dim, *self.args))

        def run(self, q, cache):
            indptr, indices, last, page_size, window_left, scale = self.args
            k_pages, v_pages = cache
            calls.append(("paged.run", q.shape, k_pages.shape))
            outs = []
            for b in range(len(indptr) - 1):
                pages = indices[indptr[b]:indptr[b + 1]]
                length = (len(pages) - 1) * page_size + last[b]
                k = k_pages[pages].flatten(0, 1)[:length]
                v = v_pages[pages].flatten(0, 1)[:length]
                outs.append(nhd_attention(q[b:b + 1], k, v, causal=True, scale=scale,
                                          window_left=window_left))
            return torch.cat(outs)

    module.single_prefill_with_kv_cache = single_prefill_with_kv_cache
    module.single_decode_with_kv_cache = single_decode_with_kv_cache
    module.BatchPrefillWithRaggedKVCacheWrapper = Ragged
    module.BatchDecodeWithPagedKVCacheWrapper = Paged
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return calls


def run_builder(name, shape, phase):
    """The provider's builder on CPU tensors in its layout, judged by the sweep's check."""
    p = provider(name)
    call = p.builder(shape, phase, "cpu")
    inputs = prov.make_inputs(shape, p.input_layout, "cpu", seed=4)
    out = call(*inputs)
    result = check_output(out, inputs, p, shape, rows=64)
    assert result.passed, (name, phase, shape.describe(), result)
    return out, inputs


@pytest.mark.parametrize("shape", [SHAPE, SHAPE.replace(causal=False),
                                   SHAPE.replace(window=(10, 0))], ids=["causal", "full", "window"])
def test_fa4_gets_flash_attn_funcs_arguments(monkeypatch, shape):
    calls = fake_fa4(monkeypatch)
    for phase in ("prefill", "decode"):
        run_builder("fa4", phase_shape(shape, phase, 48), phase)
    expected_window = (None, None) if not shape.has_window else (10, 0)
    assert [c[3:] for c in calls] == [(shape.softmax_scale, shape.causal, expected_window)] * 2
    assert calls[1][1] == (2, 1, 6, 64)  # decode: one query token, bshd


def test_fa4_paged_reads_the_cache_as_identity_pages_without_a_copy(monkeypatch):
    calls = fake_fa4(monkeypatch)
    shape = phase_shape(SHAPE, "decode", 64)
    _, (q, k, v) = run_builder("fa4_paged16", shape, "decode")
    kind, q_shape, k_shape, table, used, pointer = calls[0]
    assert (kind, q_shape, k_shape) == ("varlen", (2, 1, 6, 64), (8, 16, 2, 64))
    assert table.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and table.dtype == torch.int32
    assert used.tolist() == [64, 64] and pointer == k.data_ptr()


def test_flashinfer_batch_one_calls_the_single_request_kernels(monkeypatch):
    calls = fake_flashinfer(monkeypatch)
    one = SHAPE.replace(batch=1, window=(12, 0))
    run_builder("flashinfer", one, "prefill")
    run_builder("flashinfer", phase_shape(one, "decode", 48), "decode")
    assert calls == [("single_prefill", (48, 6, 64), True, one.softmax_scale, 12),
                     ("single_decode", (6, 64), True, one.softmax_scale, 12)]


def test_flashinfer_batches_plan_a_ragged_fa2_prefill(monkeypatch):
    calls = fake_flashinfer(monkeypatch)
    run_builder("flashinfer", SHAPE, "prefill")
    run_builder("flashinfer", phase_shape(SHAPE, "decode", 40), "decode")
    workspace = prov.FLASHINFER_WORKSPACE_BYTES
    assert calls == [
        ("ragged", "NHD", "fa2", workspace),
        ("ragged.plan", 6, 2, 64, [0, 48, 96], [0, 48, 96], True, -1, SHAPE.softmax_scale,
         torch.float32),
        ("ragged", "NHD", "fa2", workspace),
        ("ragged.plan", 6, 2, 64, [0, 1, 2], [0, 40, 80], True, -1, SHAPE.softmax_scale,
         torch.float32)]


def test_flashinfer_paged_plans_tensor_core_decode_over_16_token_pages(monkeypatch):
    calls = fake_flashinfer(monkeypatch)
    run_builder("flashinfer_paged16", phase_shape(SHAPE, "decode", 32), "decode")
    assert calls == [("paged", "NHD", True, "fa2"),
                     ("paged.plan", 6, 2, 64, [0, 2, 4], [0, 1, 2, 3], [16, 16], 16, -1,
                      SHAPE.softmax_scale),
                     ("paged.run", (2, 6, 64), (4, 16, 2, 64))]


def test_attnlab_paged_decode_reads_the_same_cache_through_its_block_table():
    out, inputs = run_builder("attnlab_decode_paged16",
                              phase_shape(SHAPE.replace(dtype="fp16"), "decode", 48), "decode")
    assert out.shape == inputs[0].shape


# ----- the kernel-name proof ----------------------------------------------------------------------
def committed_kernel_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for path in glob.glob(str(ROOT / "bench" / "results" / "**" / "*.jsonl"), recursive=True):
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("kernel") == "call" and record.get("kernel_names") \
                    and record.get("metric") != "skipped":
                names.setdefault(record["provider"], set()).add(tuple(record["kernel_names"]))
    return names


def test_the_kernel_patterns_match_every_committed_record_of_their_provider():
    names = committed_kernel_names()
    checked = set()
    for name, p in PROVIDERS.items():
        for kernel_list in names.get(name, ()) if p.kernels else ():
            assert unproven_kernels(p, list(kernel_list)) is None, (name, kernel_list)
            checked.add(name)
    # The H200 run of 2026-12-02 (bench/results/seed_*.jsonl) proved FA4's and FlashInfer's.
    # attnlab_decode_fp8: bench/fp8_h200.py's decode records, whose kernel names that script
    # lists rather than profiles (the pattern matches them; they prove nothing ran).
    assert checked == {"sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "attnlab", "attnlab_decode",
                       "attnlab_decode_paged16", "attnlab_decode_fp8", "fa4", "fa4_paged16", "flashinfer",
                       "flashinfer_paged16"}


# The names these libraries' kernels have (FA4: the CuTe DSL's entry for its sm_90 forward,
# read from the PTX it wrote for this layer; FlashInfer: its CUDA templates, demangled).
FA4_SM90 = ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at"
            "__tensorptrbf16gmemalign16o6i64div8i64div81i64div48i64div8_tensor0000o11101213_0")
FLASHINFER = {
    "flashinfer": ["void flashinfer::PrefillWithKVCacheKernel<flashinfer::CollectiveMainloop>(...)",
                   "void flashinfer::SinglePrefillWithKVCacheKernel<KTraits, Params>(Params)",
                   "void flashinfer::BatchPrefillWithRaggedKVCacheKernel<KTraits, Params>(...)"],
    "flashinfer_paged16": ["void flashinfer::BatchPrefillWithPagedKVCacheKernel<K, P>(...)"],
}


def test_the_peers_kernels_prove_them_and_others_do_not():
    cudnn = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128"
    for name in ("fa4", "fa4_paged16"):
        assert unproven_kernels(provider(name), [FA4_SM90]) is None
        assert unproven_kernels(provider(name), [cudnn]) == (
            f"the profiler saw none of {name}'s kernels (a name containing "
            f"'FlashAttentionForwardSm'); it saw {cudnn}")
    for name, kernels in FLASHINFER.items():
        for kernel in kernels:
            assert unproven_kernels(provider(name), [kernel, "void flashinfer::MergeStates"]) is None
        assert unproven_kernels(provider(name), [FA4_SM90]) is not None
    assert unproven_kernels(provider("sdpa_cudnn"), []) .endswith("it saw no kernels")
    assert unproven_kernels(provider("eager"), []) is None  # names no kernels: no claim


# ----- FlashInfer's prebuild -------------------------------------------------------------------
def test_configure_flashinfer_sets_its_cache_and_arch_before_the_import(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.delenv(peer_jit.CACHE_ENV, raising=False)
    monkeypatch.setenv(peer_jit.ARCH_ENV, "9.0a")  # a value already there wins
    assert peer_jit.configure_flashinfer(tmp_path, (9, 0)) == {
        peer_jit.CACHE_ENV: str(tmp_path), peer_jit.ARCH_ENV: "9.0a"}
    monkeypatch.delenv(peer_jit.ARCH_ENV)
    assert peer_jit.configure_flashinfer(tmp_path, (10, 0))[peer_jit.ARCH_ENV] == "10.0"
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    with pytest.raises(RuntimeError, match="before flashinfer is imported"):
        peer_jit.configure_flashinfer(tmp_path, (9, 0))


def test_each_flashinfer_call_names_the_module_it_builds():
    assert peer_jit.module_for("flashinfer", "prefill", 1) == peer_jit.SINGLE_PREFILL
    assert peer_jit.module_for("flashinfer", "decode", 1) == peer_jit.SINGLE_DECODE
    assert peer_jit.module_for("flashinfer", "decode", 16) == peer_jit.BATCH
    assert peer_jit.module_for("flashinfer", "prefill", 2) == peer_jit.BATCH
    assert peer_jit.module_for("flashinfer_paged16", "decode", 1) == peer_jit.BATCH


def test_the_prefill_backend_is_flashinfers_auto_choice():
    assert peer_jit.prefill_backend((9, 0), 256) == "fa3"
    assert peer_jit.prefill_backend((9, 0), 96) == "fa2"
    assert peer_jit.prefill_backend((10, 0), 256) == "fa2"


def test_the_prebuild_runs_every_build_and_reports_failures():
    built = []

    class Spec:
        def __init__(self, name):
            self.name = name

        def build(self, need_lock):
            assert need_lock  # FlashInfer's lock: a call needing the module waits for it
            if self.name == "bad":
                raise RuntimeError("nvcc\n failed")
            built.append(self.name)

    prebuild = peer_jit.FlashInferPrebuild({n: lambda n=n: Spec(n) for n in ("a", "bad", "c")})
    prebuild.start()
    prebuild.wait(30)
    assert prebuild.done() and prebuild.done("a") and sorted(built) == ["a", "c"]
    assert prebuild.done("not built here")
    rows = {row["module"]: row for row in prebuild.rows()}
    assert rows["bad"]["error"] == "RuntimeError: nvcc failed"
    assert rows["a"]["error"] is None and rows["a"]["seconds"] >= 0


# ----- on a GPU with the packages: each provider once against float64 ------------------------------
# The seed's head dim and dtype: FlashInfer's modules are the ones bench/seed_h200.py builds,
# in the same cache (peer_jit.DEFAULT_CACHE), so a run after it compiles nothing.
GPU_SHAPE = AttentionShape(batch=2, query_heads=12, kv_heads=2, seqlen_q=256, seqlen_k=256,
                           head_dim=256, dtype="bf16", causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, phase", [(n, ph) for n in PEERS for ph in PROVIDERS[n].phases])
def test_each_peer_matches_float64_and_runs_its_own_kernel(name, phase):
    """Skipped with the provider's reason where its package is absent.  FlashInfer's first
    run on a machine compiles its modules (minutes of nvcc, unless seed_h200 ran first)."""
    from attnlab.accuracy import check_gradients
    from attnlab.measure.dispatch import profile_call

    if "flashinfer" not in sys.modules:
        peer_jit.configure_flashinfer(peer_jit.DEFAULT_CACHE,
                                      tuple(torch.cuda.get_device_capability()))
    p = provider(name)
    shape = phase_shape(GPU_SHAPE, phase, 512 if phase == "decode" else 256)
    reason = p.reason(shape, phase, "cuda")
    if reason:
        pytest.skip(reason)
    call = prepare(p, shape, phase, "cuda")
    inputs = call.inputs(seed=1)
    assert check_output(call.forward(*inputs[:3]), inputs, p, shape).passed
    assert unproven_kernels(p, profile_call(call.call, inputs).names()) is None
    if phase == "fwdbwd":
        bhsd = [prov.to_bhsd(t.detach(), p.input_layout) for t in inputs]
        grads = [prov.to_bhsd(g, p.input_layout) for g in call.call(*inputs)]
        checks = check_gradients(grads, *bhsd, causal=True, scale=shape.softmax_scale)
        assert all(c.passed for c in checks), checks
