"""Varlen on the H200 (issue #14): attnlab's packed batches against padding and documents.

    PYTHONPATH=src python3 bench/varlen_h200.py --out $OUT [--quick] [--mixes a,b,c]
        [--phases correct,prefill,fwdbwd] [--no-flex]

bf16, d = 128, 16 heads, causal, 16,384 real tokens per batch, in three mixes:

* ``a``: 16 sequences x 1,024;
* ``b``: a long-tailed mix, lengths log-uniform in 64 ... 8,192 (seed 0), the last one
  trimmed so the batch holds exactly 16,384 tokens (written to varlen_mixes.json);
* ``c``: one sequence of 16,384.

Providers, all in one process and one run:

* ``attnlab_varlen``: the varlen kernel through ``attnlab.kernels.autograd.attention_forward``
  (what ``flash_attn_varlen_func`` runs after its checks);
* ``attnlab_varlen_api``: the whole public call, with its one small device-to-host copy of
  cu_seqlens (so never graph-captured; forward only);
* ``attnlab``, ``sdpa_cudnn``: the dense kernels on the batch right-padded to its longest
  sequence (``attnlab.measure.providers``; causal on the padded square is exact for the
  real tokens);
* ``flex_document``: FlexAttention (compiled) on the packed batch with a document-causal
  block mask; skipped with its reason if it fails.

Correctness first (each varlen sequence against the float64 reference by the accuracy
rule, two heads per sequence; varlen gradients on the sequences of <= 2,048 tokens; the
padded providers against varlen on the real tokens), then timing with
``attnlab.measure.timing.time_call`` (cold L2 per call; short calls as graph replays).

**Useful TFLOP/s**: every provider is credited with the same work, the exact visible
(query, key) pairs of the real tokens only (``attnlab.model.flops``, causal per
sequence), so padding and cross-document tiles count as waste.  Records (the schema of
``attnlab.measure.records``; ``shape`` is the padded batch the mix fits in, the mix's
lengths are in varlen_mixes.json) go to ``--out``/varlen_h200.jsonl; the table is last.

A configuration of attnlab.measure.engine (phases, --out, environment, records);
``--device cpu --tokens 256`` is a smoke run of the script itself under
TRITON_INTERPRET=1 (tests/test_bench_engine.py runs it).

Not measured here: a packed (sequence, block) work list instead of the
(max blocks x batch x heads) grid; mix b's idle programs (blocks past a short
sequence's end exit after reading cu_seqlens) are the cost it would remove.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import traceback

import torch

from attnlab.accuracy import check_accuracy, check_gradients
from attnlab.measure import records as rec
from attnlab.measure.engine import Bench
from attnlab.measure.providers import PROVIDERS, ProviderUnavailable, prepare
from attnlab.measure.timing import time_call
from attnlab.model.flops import attention_flops, backward_flops
from attnlab.shapes import AttentionShape

HEADS, HEAD_DIM = 16, 128
TOKENS = 16384  # --tokens (smaller only for a CPU smoke run)
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself under TRITON_INTERPRET=1
DTYPE = torch.bfloat16
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def mix_lengths(name: str, seed: int = 0) -> list[int]:
    if name == "a":
        return [TOKENS // 16] * 16
    if name == "c":
        return [TOKENS]
    rng = random.Random(seed)
    lengths: list[int] = []
    longest_log2 = math.log2(TOKENS // 2)  # 8192 at 16k tokens
    while sum(lengths) < TOKENS:
        length = int(round(2 ** rng.uniform(6, longest_log2)))  # 64 ... 8192: long-tailed
        lengths.append(min(length, TOKENS - sum(lengths)))
    if lengths[-1] < 64 and len(lengths) > 1:  # keep every sequence >= 64 tokens
        tail = lengths.pop()
        lengths[-1] += tail
    return lengths


def useful_flops(lengths: list[int], phase: str) -> int:
    total = 0
    for length in lengths:
        shape = AttentionShape(query_heads=HEADS, kv_heads=HEADS, seqlen_q=length, seqlen_k=length,
                               head_dim=HEAD_DIM, dtype="bf16", causal=True)
        total += attention_flops(shape) + (backward_flops(shape) if phase == "fwdbwd" else 0)
    return total


def padded_shape(lengths: list[int]) -> AttentionShape:
    return AttentionShape(batch=len(lengths), query_heads=HEADS, kv_heads=HEADS,
                          seqlen_q=max(lengths), seqlen_k=max(lengths), head_dim=HEAD_DIM,
                          dtype="bf16", causal=True)


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


def pad(packed: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(total, heads, dim) -> (batch, heads, longest, dim) bhsd, zeros after each sequence."""
    out = packed.new_zeros((len(lengths), max(lengths), HEADS, HEAD_DIM))
    start = 0
    for i, length in enumerate(lengths):
        out[i, :length] = packed[start:start + length]
        start += length
    return out.transpose(1, 2).contiguous()


def unpad(padded_bhsd: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.cat([padded_bhsd[i, :, :length].transpose(0, 1)
                      for i, length in enumerate(lengths)])


class Mix:
    def __init__(self, name: str, seed: int):
        self.name = name
        self.lengths = mix_lengths(name, seed)
        gen = torch.Generator(device=DEVICE).manual_seed(seed + ord(name))
        self.q, self.k, self.v, self.dout = (
            torch.randn(TOKENS, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
            for _ in range(4))
        self.cu = cumulative(self.lengths)
        self.shape = padded_shape(self.lengths)

    def varlen_args(self) -> dict:
        return dict(layout="thd", scale=SCALE, causal=True, window=(-1, -1), softcap=0.0,
                    cu_seqlens_q=self.cu, cu_seqlens_k=self.cu,
                    max_seqlen_q=max(self.lengths), max_seqlen_k=max(self.lengths))

    def sequences(self):
        start = 0
        for length in self.lengths:
            yield slice(start, start + length)
            start += length


# ---------------------------------------------------------------------------
# Providers: (forward callable, inputs, pin, cuda_graph) per phase
# ---------------------------------------------------------------------------

def _grad_of(forward):
    def forward_backward(q, k, v, dout):
        return torch.autograd.grad(forward(q, k, v), (q, k, v), dout)
    return forward_backward


def _leaves(mix: Mix, phase: str) -> tuple:
    if phase != "fwdbwd":
        return mix.q, mix.k, mix.v
    return (*(t.detach().clone().requires_grad_() for t in (mix.q, mix.k, mix.v)), mix.dout)


def build_varlen(mix: Mix, phase: str):
    from attnlab.kernels.autograd import attention_forward

    args = mix.varlen_args()

    def forward(q, k, v):
        return attention_forward(q, k, v, **args)[0]

    return (_grad_of(forward) if phase == "fwdbwd" else forward), _leaves(mix, phase), None, None


def build_varlen_api(mix: Mix, phase: str):
    import attnlab

    if phase == "fwdbwd":
        raise ProviderUnavailable("timed forward only (its backward is attnlab_varlen's)")
    longest = max(mix.lengths)

    def forward(q, k, v):
        return attnlab.flash_attn_varlen_func(q, k, v, mix.cu, mix.cu, longest, longest,
                                              causal=True)

    # Its cu_seqlens checks copy to the host, which a CUDA graph cannot capture.
    return forward, (mix.q, mix.k, mix.v), None, False


def build_padded(provider_name: str):
    def build(mix: Mix, phase: str):
        call = prepare(PROVIDERS[provider_name], mix.shape, phase, DEVICE)
        q, k, v = (pad(t, mix.lengths) for t in (mix.q, mix.k, mix.v))
        if phase == "fwdbwd":
            inputs = (*(t.requires_grad_() for t in (q, k, v)), pad(mix.dout, mix.lengths))
        else:
            inputs = (q, k, v)
        return call.unpinned_call, inputs, call.pin, None
    return build


def build_flex_document(mix: Mix, phase: str):
    from torch.nn.attention.flex_attention import create_block_mask

    from attnlab.measure.providers import _compiled_flex  # the registry's compile settings

    flex = _compiled_flex()
    document = torch.repeat_interleave(torch.arange(len(mix.lengths), device=DEVICE),
                                       torch.tensor(mix.lengths, device=DEVICE))

    def document_causal(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(document_causal, B=None, H=None, Q_LEN=TOKENS, KV_LEN=TOKENS,
                                   device=DEVICE)

    def forward(q, k, v):  # packed (total, heads, dim) <-> flex's (1, heads, total, dim)
        out = flex(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block_mask,
                   scale=SCALE)
        return out[0].transpose(0, 1)

    return (_grad_of(forward) if phase == "fwdbwd" else forward), _leaves(mix, phase), None, None


BUILDERS = {
    "attnlab_varlen": build_varlen,
    "attnlab_varlen_api": build_varlen_api,
    "attnlab": build_padded("attnlab"),
    "sdpa_cudnn": build_padded("sdpa_cudnn"),
    "flex_document": build_flex_document,
}


# ---------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------

def check_mix(mix: Mix, phases, providers, log) -> int:
    """Failures: varlen per sequence vs float64; gradients on short sequences; peers vs varlen."""
    from attnlab.kernels.autograd import attention_forward

    failures = 0
    out, lse = attention_forward(mix.q, mix.k, mix.v, **mix.varlen_args())
    for index, rows in enumerate(mix.sequences()):
        for head in (0, HEADS - 1):
            one = [t[None, rows, head:head + 1] for t in (mix.q, mix.k, mix.v, out)]
            result = check_accuracy(one[3], lse[None, head:head + 1, rows], *one[:3], scale=SCALE,
                                    causal=True, layout="bshd")
            failures += not result.passed
            log(check="forward", sequence=index, length=rows.stop - rows.start, head=head,
                error=result.error, allowed=result.allowed, lse_error=result.lse_error,
                passed=result.passed)
    if "fwdbwd" in phases:
        leaves = [t.detach().clone().requires_grad_() for t in (mix.q, mix.k, mix.v)]
        grads = torch.autograd.grad(attention_forward(*leaves, **mix.varlen_args())[0], leaves,
                                    mix.dout)
        for index, rows in enumerate(mix.sequences()):
            if rows.stop - rows.start > 2048:  # the CPU float64 autograd oracle stays small
                continue
            head = slice(0, 1)
            checks = check_gradients([g[None, rows, head] for g in grads],
                                     *(t[None, rows, head] for t in (mix.q, mix.k, mix.v)),
                                     mix.dout[None, rows, head], causal=True, scale=SCALE,
                                     layout="bshd")
            passed = all(c.passed for c in checks)
            failures += not passed
            log(check="gradients", sequence=index, length=rows.stop - rows.start, head=0,
                errors={c.name: c.error for c in checks},
                allowed={c.name: c.allowed for c in checks}, passed=passed)
    for name in providers:
        if name in ("attnlab_varlen", "attnlab_varlen_api"):
            continue
        try:
            forward, inputs, pin, _ = BUILDERS[name](mix, "prefill")
            if pin is not None:
                with pin():
                    got = forward(*inputs)
            else:
                got = forward(*inputs)
            if got.dim() == 4:  # padded bhsd -> packed
                got = unpad(got, mix.lengths)
            difference = (got.float() - out.float()).abs().max().item()
            ok = math.isfinite(difference) and difference < 0.05
        except Exception as error:  # noqa: BLE001 - a peer that cannot run is recorded
            difference, ok = None, False
            print(f"  {mix.name} {name}: check failed to run: {str(error)[:200]}", flush=True)
        log(check="peer_vs_varlen", provider=name, max_abs_difference=difference, passed=ok)
        if not ok:
            print(f"  {mix.name} {name}: differs from varlen on the real tokens "
                  f"({difference})", flush=True)
    return failures


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------

def time_provider(name: str, mix: Mix, phase: str, env: dict, target_ms: float) -> dict:
    try:
        fn, inputs, pin, cuda_graph = BUILDERS[name](mix, phase)
        result = time_call(fn, [inputs], device=DEVICE, target_ms=target_ms, context=pin,
                           cuda_graph=cuda_graph if DEVICE == "cuda" else False,
                           **({} if DEVICE == "cuda" else {"repeats": 1, "warmup": 1}))
    except Exception as error:  # noqa: BLE001 - a provider's failure is a result too
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        print(f"  {mix.name} {phase} {name}: skipped ({reason})", flush=True)
        return rec.skipped_record(provider=name, phase=phase, shape=mix.shape, reason=reason,
                                  env=env)
    seconds = result.p50 / 1e3
    return rec.make_record(
        kernel="call", provider=name, phase=phase, shape=mix.shape, metric="latency", unit="ms",
        p20=result.p20, p50=result.p50, p80=result.p80, repeats=result.repeats, env=env,
        tflops=useful_flops(mix.lengths, phase) / seconds / 1e12,
        timing_method=result.describe_method())


bench = Bench("varlen_h200", __doc__, devices=("cuda", "cpu"))
bench.option("--mixes", default="a,b,c")
bench.option("--providers", default=",".join(BUILDERS))
bench.option("--no-flex", action="store_true", help="leave FlexAttention out")
bench.option("--quick", action="store_true", help="shorter timing (50 ms a point)")
bench.option("--seed", type=int, default=0)
bench.option("--tokens", type=int, default=16384, help=argparse.SUPPRESS)


def chosen_providers(args) -> list[str]:
    names = [p for p in args.providers.split(",") if p]
    unknown = [p for p in names if p not in BUILDERS]
    if unknown:
        raise ValueError(f"--providers: unknown provider {unknown[0]!r}; this script's are "
                         f"{', '.join(BUILDERS)}")
    return [p for p in names if not (args.no_flex and p == "flex_document")]


def mix_names(args) -> list[str]:
    names = [m for m in args.mixes.split(",") if m]
    unknown = [m for m in names if m not in ("a", "b", "c")]
    if unknown or not names:
        raise ValueError(f"--mixes must be comma-separated from a, b, c, got {args.mixes!r}")
    return names


def timing_plan(args) -> list[tuple[str, str]]:
    return [(mix, provider) for mix in mix_names(args) for provider in chosen_providers(args)]


@bench.setup
def build_mixes(ctx) -> None:
    globals().update(TOKENS=ctx.args.tokens, DEVICE=ctx.device)
    ctx.results["mixes"] = {name: Mix(name, ctx.args.seed) for name in mix_names(ctx.args)}
    for name, mix in ctx.results["mixes"].items():
        print(f"mix {name}: {len(mix.lengths)} sequences, longest {max(mix.lengths)}", flush=True)
    ctx.path("varlen_mixes.json").write_text(json.dumps(
        {name: mix.lengths for name, mix in ctx.results["mixes"].items()}, indent=1))


@bench.phase("correct", plan=mix_names)
def correct(ctx) -> None:
    """Each varlen sequence against float64, gradients on the short ones, peers against varlen."""
    providers = chosen_providers(ctx.args)
    for name in ctx.plan:
        mix = ctx.results["mixes"][name]

        def log(**row):
            ctx.append_row("varlen_correctness.jsonl", {"mix": name, **row})

        try:
            ctx.fail(check_mix(mix, ctx.phases, providers, log))
        except Exception:  # noqa: BLE001 - the next mix still runs; the traceback is the record
            traceback.print_exc()
            log(check="crashed", passed=False)
            ctx.fail()


def time_phase(ctx) -> list[tuple[str, dict]]:
    """Each provider on each mix, timed; useful TFLOP/s from the real tokens' pairs."""
    target_ms = 50.0 if ctx.args.quick else 150.0
    records = []
    for name, provider in ctx.within_budget(ctx.plan, label=lambda point: "/".join(point)):
        record = time_provider(provider, ctx.results["mixes"][name], ctx.phase, ctx.env,
                               target_ms)
        records.append((name, record))
        ctx.upsert("varlen_h200.jsonl", [record])
        if record["metric"] != rec.SKIPPED:
            print(f"  {name} {ctx.phase:7s} {provider:19s} {record['p50']:.3f} ms  "
                  f"{record['tflops']:.0f} useful TFLOP/s", flush=True)
    return records


bench.phase("prefill", plan=timing_plan)(time_phase)
bench.phase("fwdbwd", plan=timing_plan)(time_phase)


@bench.finish
def print_table(ctx) -> None:
    providers = chosen_providers(ctx.args)
    print("\nuseful TFLOP/s (real tokens only), bf16 d=128 16 heads causal, 16k tokens")
    print(f"{'mix':4s} {'phase':8s} " + " ".join(f"{p:>19s}" for p in providers)
          + "   varlen/cudnn  varlen/flex  varlen/dense")
    for name in ctx.results.get("mixes", {}):
        for phase in ("prefill", "fwdbwd"):
            row = {r["provider"]: r for n, r in ctx.results.get(phase) or [] if n == name}
            if not row:
                continue

            def tflops(p):
                r = row.get(p)
                return r["tflops"] if r and r["metric"] != rec.SKIPPED else float("nan")

            ours = tflops("attnlab_varlen")
            print(f"{name:4s} {phase:8s} " + " ".join(f"{tflops(p):19.0f}" for p in providers)
                  + f"   {ours / tflops('sdpa_cudnn'):11.2f}x {ours / tflops('flex_document'):11.2f}x"
                  f" {ours / tflops('attnlab'):11.2f}x")


if __name__ == "__main__":
    sys.exit(bench.main())
