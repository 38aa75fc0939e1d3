"""A real training check: a tiny GPT and a Qwen3-shaped model trained with attnlab and SDPA.

    PYTHONPATH=src python3 bench/train_check_h200.py --out $OUT [--steps 200]
    PYTHONPATH=src python3 bench/train_check_h200.py --out $OUT --phases qwen3 [--quick]

A 4-layer byte-level decoder (d_model 256, 4 heads of 64, context 256, random init)
learns the source text of a few Python standard-library modules (shipped with every
Python).  Three runs, same data order: attnlab (init seed 0), SDPA (init seed 0) and
SDPA (init seed 1, the run-to-run spread).  attnlab passes when its loss curve stays
within the spread of SDPA against itself.  Attention runs in bf16 (q, k, v cast from
the fp32 model); everything else is fp32.

Writes ``train_check.jsonl`` (one line per run and step, then a summary line) and
``train_check.png`` into --out.  About a minute on the H200.

Phase ``qwen3`` (only when asked): the seed's model shape in transformers -- a
Qwen3ForCausalLM (random init, byte vocabulary) with 24 query / 4 KV heads of head dim
256, bf16 autocast over fp32 weights, AdamW at a fixed data order -- trained with
``attn_implementation="attnlab"`` (init seed 0) and ``"sdpa"`` (init seeds 0 and 1).
attnlab passes when its loss at every step stays within SDPA's seed-to-seed spread (the
largest |loss_sdpa0 - loss_sdpa1| after the first step) and its first-step loss, same
init as SDPA's seed 0, differs from it by less than a percent.  The step time (median of
synchronised steps after two warm-up ones) is recorded beside SDPA's.  ``--quick``: 2
layers (hidden 1024), 2 x 2048 tokens, 10 steps, about a minute with the d = 256
kernels' compiles;
otherwise 4 layers, 4 x 4096 tokens, 30 steps.  Writes ``train_check_qwen3.jsonl`` (one
line per run and step, a record per provider's step time, then a summary line).
A configuration of attnlab.measure.engine (phases ``train``, ``qwen3``).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import attnlab
from attnlab.measure.engine import Bench

CORPUS_MODULES = ("argparse", "textwrap", "difflib", "inspect", "dataclasses", "typing")


def corpus_bytes() -> torch.Tensor:
    parts = []
    for name in CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin, "rb") as handle:
            parts.append(handle.read())
    data = b"\n".join(parts)
    if len(data) < 100_000:
        raise RuntimeError(f"the stdlib corpus is only {len(data)} bytes; expected > 100 kB")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def attention_sdpa(q, k, v):
    """q, k, v: (batch, seqlen, heads, head_dim) -> same layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def attention_attnlab(q, k, v):
    return attnlab.flash_attn_func(q, k, v, causal=True, impl="triton")


class Block(nn.Module):
    def __init__(self, width: int, heads: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, seqlen, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seqlen, 3, self.heads, width // self.heads)
        q, k, v = (t.to(torch.bfloat16) for t in qkv.unbind(2))
        attended = self.attend(q, k, v).float().reshape(batch, seqlen, width)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, attend, *, layers=4, width=256, heads=4, context=256, vocab=256):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, attend) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(attend, init_seed: int, data: torch.Tensor, steps: int, batch: int,
          context: int) -> list[float]:
    torch.manual_seed(init_seed)
    model = TinyGPT(attend, context=context).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    data_order = torch.Generator().manual_seed(1234)  # the same batches for every run
    losses = []
    for step in range(steps):
        starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=data_order)
        window = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).cuda()
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:  # 20 warm-up steps, then cosine decay
            group["lr"] = 1e-3 * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        optimizer.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"loss became {losses[-1]} at step {step}")
    return losses


def smoothed(values: list[float], width: int = 10) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / (i + 1 - max(0, i - width + 1))
            for i in range(len(values))]


bench = Bench("train_check_h200", __doc__)
bench.option("--steps", type=int, default=200)
bench.option("--batch", type=int, default=16)
bench.option("--context", type=int, default=256)


@bench.phase("train")
def train_check(ctx) -> None:
    """attnlab, SDPA and SDPA with another seed train the same tiny GPT; the gaps compared."""
    args, env = ctx.args, ctx.env
    data = corpus_bytes()
    print(f"corpus: {data.numel()} bytes from {', '.join(CORPUS_MODULES)}", flush=True)

    runs = {}
    for name, attend, seed in (("attnlab_seed0", attention_attnlab, 0),
                               ("sdpa_seed0", attention_sdpa, 0),
                               ("sdpa_seed1", attention_sdpa, 1)):
        started = time.time()
        try:
            runs[name] = train(attend, seed, data, args.steps, args.batch, args.context)
        except Exception as error:  # noqa: BLE001 - record the failure, run the others
            print(f"{name} failed: {type(error).__name__}: {error}", flush=True)
            continue
        print(f"{name}: loss {runs[name][0]:.3f} -> {runs[name][-1]:.3f} "
              f"({time.time() - started:.1f} s)", flush=True)

    rows = [{"what": "train_loss", "run": name, "step": step, "loss": loss}
            for name, losses in runs.items() for step, loss in enumerate(losses)]
    summary = {"what": "train_check_summary", "steps": args.steps, "batch": args.batch,
               "context": args.context, "corpus_bytes": data.numel(), **env}
    if {"attnlab_seed0", "sdpa_seed0", "sdpa_seed1"} <= runs.keys():
        ours, same, other = (smoothed(runs[n]) for n in ("attnlab_seed0", "sdpa_seed0",
                                                         "sdpa_seed1"))
        # After warm-up: the largest gap of the smoothed curves, ours vs SDPA's own spread.
        skip = min(20, args.steps // 4)
        gap = max(abs(a - b) for a, b in zip(ours[skip:], same[skip:], strict=True))
        spread = max(abs(a - b) for a, b in zip(same[skip:], other[skip:], strict=True))
        summary.update(max_gap_attnlab_vs_sdpa=gap, max_gap_sdpa_seed0_vs_seed1=spread,
                       final_loss={n: runs[n][-1] for n in runs}, passed=gap <= spread)
        print(f"smoothed loss gap attnlab vs SDPA (same seed): {gap:.4f}; SDPA seed 0 vs 1: "
              f"{spread:.4f} -> {'PASS' if gap <= spread else 'FAIL'}", flush=True)
    else:
        summary.update(passed=False, error="a run failed; see the log")
    ctx.write_rows("train_check.jsonl", [*rows, summary])

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        for name, losses in runs.items():
            axis.plot(losses, alpha=0.25)
            axis.plot(smoothed(losses), label=name.replace("_", ", "))
        axis.set_xlabel("step")
        axis.set_ylabel("cross-entropy (nats/byte)")
        axis.set_title("tiny GPT on stdlib source: attnlab vs SDPA attention (bf16)")
        axis.legend()
        figure.tight_layout()
        figure.savefig(ctx.path("train_check.png"), dpi=120)
    except Exception as error:  # noqa: BLE001 - the numbers stand without the plot
        print(f"plot failed: {error}", flush=True)
    ctx.fail(not summary.get("passed"))


QWEN3_SHAPES = {  # (layers, hidden, intermediate, batch, seqlen, steps)
    "quick": (2, 1024, 3072, 2, 2048, 10),
    "full": (4, 2048, 6144, 4, 4096, 30),
}


def train_qwen3(attn_implementation: str, init_seed: int, data: torch.Tensor, *, layers: int,
                hidden: int, intermediate: int, batch: int, seqlen: int,
                steps: int) -> tuple[list[float], list[float]]:
    """(loss per step, seconds per step) of a Qwen3-shaped model (24q/4kv, head dim 256)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=24,
                         num_key_value_heads=4, head_dim=256, max_position_embeddings=seqlen,
                         tie_word_embeddings=False)
    torch.manual_seed(init_seed)
    model = Qwen3ForCausalLM(config).cuda()
    model.config._attn_implementation = attn_implementation
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    data_order = torch.Generator().manual_seed(1234)  # the same batches for every run
    losses, seconds = [], []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seqlen - 1, (batch,), generator=data_order)
        tokens = torch.stack([data[s:s + seqlen] for s in starts.tolist()]).cuda()
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"loss became {losses[-1]} at step {len(losses) - 1}")
    return losses, seconds


@bench.phase("qwen3", default=False, cap_s=300.0)
def qwen3_check(ctx) -> None:
    """The seed's model shape in transformers: attnlab vs SDPA's seed-to-seed spread."""
    import statistics

    import attnlab.integrations.transformers as attnlab_hf
    from attnlab.measure.records import make_record
    from attnlab.shapes import AttentionShape

    attnlab_hf.register()
    layers, hidden, intermediate, batch, seqlen, steps = QWEN3_SHAPES[
        "quick" if ctx.args.quick else "full"]
    sizes = dict(layers=layers, hidden=hidden, intermediate=intermediate, batch=batch,
                 seqlen=seqlen, steps=steps)
    data = corpus_bytes()
    shape = AttentionShape(batch=batch, query_heads=24, kv_heads=4, seqlen_q=seqlen,
                           seqlen_k=seqlen, head_dim=256, dtype="bf16", causal=True)
    runs, times = {}, {}
    for name, implementation, seed in (("attnlab_seed0", "attnlab", 0),
                                       ("sdpa_seed0", "sdpa", 0), ("sdpa_seed1", "sdpa", 1)):
        if ctx.spent():
            ctx.unmeasured([name])
            continue
        started = time.time()
        try:
            runs[name], times[name] = train_qwen3(implementation, seed, data, **sizes)
        except Exception as error:  # noqa: BLE001 - record the failure, run the others
            print(f"{name} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            ctx.append_row("train_check_qwen3.jsonl", {"what": "qwen3_run_failed", "run": name,
                                                       "error": str(error)[:500], **sizes})
            continue
        step_s = statistics.median(times[name][2:])
        for step, (loss, took) in enumerate(zip(runs[name], times[name], strict=True)):
            ctx.append_row("train_check_qwen3.jsonl", {"what": "qwen3_train_loss", "run": name,
                                                       "step": step, "loss": loss,
                                                       "seconds": took, **sizes})
        provider = "attnlab" if implementation == "attnlab" else f"sdpa_seed{seed}"
        fifths = statistics.quantiles(times[name][2:], n=5, method="inclusive")
        ctx.upsert("train_check_qwen3_records.jsonl", [make_record(
            kernel=f"qwen3 train step ({layers} layers, hidden {hidden})", provider=provider,
            phase="fwdbwd", shape=shape.as_dict(), metric="step_time", unit="ms",
            p20=1e3 * fifths[0], p50=1e3 * step_s, p80=1e3 * fifths[3],
            repeats=len(times[name]) - 2, env=ctx.env)])
        print(f"{name}: loss {runs[name][0]:.4f} -> {runs[name][-1]:.4f}, step "
              f"{1e3 * step_s:.1f} ms ({time.time() - started:.1f} s with compiles)", flush=True)
    summary = {"what": "qwen3_train_check_summary", **sizes, **ctx.env}
    if {"attnlab_seed0", "sdpa_seed0", "sdpa_seed1"} <= runs.keys():
        ours, same, other = (runs[n] for n in ("attnlab_seed0", "sdpa_seed0", "sdpa_seed1"))
        gaps = [abs(a - b) for a, b in zip(ours, same, strict=True)]
        spread = max(abs(a - b) for a, b in zip(same[1:], other[1:], strict=True))
        first = gaps[0] / abs(same[0])
        step_ratio = statistics.median(times["attnlab_seed0"][2:]) / statistics.median(
            times["sdpa_seed0"][2:])
        passed = max(gaps[1:]) <= spread and first < 0.01
        summary.update(max_gap_attnlab_vs_sdpa=max(gaps[1:]), seed_spread_sdpa=spread,
                       first_step_relative_gap=first, step_time_ratio_vs_sdpa=step_ratio,
                       final_loss={n: runs[n][-1] for n in runs}, passed=passed)
        print(f"loss gap attnlab vs SDPA (same init) max {max(gaps[1:]):.4f}, first step "
              f"{first:.2e} relative; SDPA seed 0 vs 1: {spread:.4f}; step time "
              f"{step_ratio:.2f}x SDPA's -> {'PASS' if passed else 'FAIL'}", flush=True)
    else:
        summary.update(passed=False, error="a run failed or the budget ran out; see the log")
    ctx.append_row("train_check_qwen3.jsonl", summary)
    ctx.fail(not summary.get("passed"))


bench.option("--quick", action="store_true", help="qwen3: 2 layers, 2 x 2048 tokens, 10 steps")

if __name__ == "__main__":
    sys.exit(bench.main())
