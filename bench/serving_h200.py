"""A transformers decoder's generate loop with each attention implementation: tokens/s,
time per token, where each step's time goes, and a greedy-token check that can fail.

    PYTHONPATH=src python3 bench/serving_h200.py --out OUT [--quick]

The model is transformers' ``LlamaForCausalLM`` with random weights (no download) at two
attention shapes: ``seed`` (the seed's layer: 24 query / 4 KV heads, d = 256) and
``llama`` (32 / 8 heads, d = 128, Llama-3-8B's attention), 8 layers, bf16.  Each point
(shape, batch in 1 / 8 / 32) prefills a 4k-token prompt and generates 256 tokens
greedily with ``model.generate`` (transformers' DynamicCache) under each provider:
``attnlab`` (attnlab.integrations.transformers: the decode steps reach the split-KV
kernel through ``attnlab.attention``), transformers' ``sdpa`` (and, on CUDA, the same with
SDPA's flash or cuDNN backend pinned around the generate: ``sdpa_flash``, ``sdpa_cudnn``),
``eager`` and ``flash_attention_2`` where flash-attn is installed.  Per provider and point:

* **time per token**: (generate of N tokens - generate of 1 token) / (N - 1), the decode
  step without the prefill; **tokens/s** = batch / time per token;
* **where a step goes** (torch.profiler over 4 decode steps, classified by
  attnlab.measure.profile): attention kernels, GEMMs, other kernels, and GPU idle time
  (the host's share: Python, launches, mask building); every provider's attention core
  runs inside ``record_function("attention")``, so eager's matmuls count as attention;
* **the greedy-token check**: SDPA's greedy tokens are fed back (teacher forcing) through
  every provider for 32 steps after the prompt's first 64 tokens (``CHECK_PROMPT``); a
  step is *decided* where SDPA's top-1 logit leads the second by more than 3x the logit
  difference between two correct implementations (eager vs SDPA at that step; without
  eager, 2^-7 of the largest logit).  A provider must give SDPA's token at every decided
  step, and at every step its logits within 3x that gap of SDPA's (a random model
  decides few steps: session 9 found 2 of 16 and 35 of 128; its logits still show what
  each implementation attended to).  The check is shown able to fail: a sabotaged
  attnlab that drops the newest cached key (an off-by-one cache length) must fail one
  of the two somewhere, else the check is reported as unable to judge.
  (Scaling the LM head would not help: it scales the margins and the noise alike; nor
  did sharper attention (q, k projections x 2 or x 4) make the sabotage easier to see
  in a CPU trial: a peaked query mostly ignores the newest key.)

Each point's rows are written when the point is done (serving.jsonl; contract records of
the time per token in serving_records.jsonl; the step traces under traces/); a provider that fails (out of memory: eager
at batch 32) is recorded with its reason and the run goes on; the table is printed last.

``--quick`` (the lead's GPU call, ~50-60 s): the llama shape, 2 layers, 32 new tokens
(12 checked), batch 1 and 8.  ``--device cpu --tiny`` runs the whole path on a toy model (tests).
A configuration of attnlab.measure.engine.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

from attnlab.measure.engine import Bench

bench = Bench("serving_h200", __doc__, devices=("cuda", "cpu"))
bench.option("--quick", action="store_true",
             help="llama shape, 2 layers, 32 new tokens, batch 1 and 8 (~50-60 s)")
bench.option("--tiny", action="store_true", help="a toy model (CPU smoke runs)")

SHAPES = {  # query heads, kv heads, head dim, hidden, MLP hidden
    "seed": (24, 4, 256, 3072, 8192),
    "llama": (32, 8, 128, 4096, 14336),
}
PROVIDERS = ("attnlab", "sdpa", "eager", "flash_attention_2", "sdpa_flash", "sdpa_cudnn")
# transformers' sdpa with one SDPA backend pinned around the whole generate (entered before
# the timed region): session 9 measured sdpa at ~10x eager's time per token with only
# ~7 ms of each step on the profile, and the pinned runs say which backend costs it.
SDPA_PINS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}
VOCAB = 32000
CHECK_STEPS = 32
# The check's prompt: the timed prompt's first tokens.  Behind a 4k prompt the sabotage
# (the newest key dropped) moved a random model's logits no more than eager differs from
# SDPA (session 12 run 3: it passed every step); behind 64 keys one key is 1/64 of the
# attention, and on the CPU toy model (48 tokens) the sabotage fails the check.
CHECK_PROMPT = 64
PROFILE_STEPS = 4
# A decided step: SDPA's top-1 logit leads by this many times the correct-vs-correct gap.
DECISION_FACTOR = 3.0
# Without eager's logits, the gap of two correct bf16 runs is taken as this share of the
# largest logit (a few bf16 ulps).
FALLBACK_RELATIVE_GAP = 2.0**-7


def run_settings(args) -> dict:
    if args.tiny:
        return dict(shapes={"tiny": (4, 2, 32, 64, 128)}, layers=1, prompt=48, new=8,
                    batches=(1, 2), vocab=500, check_steps=4)
    if args.quick:
        return dict(shapes={"llama": SHAPES["llama"]}, layers=2, prompt=4096, new=32,
                    batches=(1, 8), vocab=VOCAB, check_steps=12)
    return dict(shapes=SHAPES, layers=8, prompt=4096, new=256, batches=(1, 8, 32), vocab=VOCAB,
                check_steps=CHECK_STEPS)


def points(args) -> list[tuple[str, int]]:
    settings = run_settings(args)
    return [(shape, batch) for shape in settings["shapes"] for batch in settings["batches"]]


# ----- the model and the providers ------------------------------------------------------------
def scoped(fn):
    """``fn`` inside record_function("attention"): the classifier's attention scope."""
    def attention_in_scope(*args, **kwargs):
        with torch.profiler.record_function("attention"):
            return fn(*args, **kwargs)
    return attention_in_scope


def register_providers(device: str) -> dict[str, str]:
    """Each available provider under a scoped name (its own mask function kept):
    provider -> the attn_implementation to set.  Missing ones are left out."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.llama import modeling_llama
    from transformers.utils import is_flash_attn_2_available

    import attnlab.integrations.transformers as attnlab_hf

    attnlab_hf.register(impl="auto")
    functions = {"attnlab": (AttentionInterface._global_mapping["attnlab"], "attnlab"),
                 "sdpa": (AttentionInterface._global_mapping["sdpa"], "sdpa"),
                 "eager": (modeling_llama.eager_attention_forward, "eager"),
                 "sabotaged": (off_by_one(AttentionInterface._global_mapping["attnlab"]),
                               "attnlab")}
    if device == "cuda" and is_flash_attn_2_available():
        functions["flash_attention_2"] = (AttentionInterface._global_mapping["flash_attention_2"],
                                          "flash_attention_2")
    names = {}
    for provider, (fn, mask) in functions.items():
        name = f"scoped_{provider}"
        AttentionInterface.register(name, scoped(fn))
        AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[mask])
        names[provider] = name
    if device == "cuda":
        names.update({provider: names["sdpa"] for provider in SDPA_PINS})
    return names


def pinned(provider: str):
    """The SDPA backend pin a provider runs under (a no-op for the others)."""
    import contextlib

    if provider not in SDPA_PINS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_PINS[provider])])


def off_by_one(fn):
    """attnlab attention that drops the newest cached key of a decode step: the bug the
    greedy check must catch."""
    def dropping_the_last_key(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] == 1 and key.shape[2] > 1:
            key, value = key[:, :, :-1], value[:, :, :-1]
            if attention_mask is not None:
                attention_mask = attention_mask[..., :-1]
        return fn(module, query, key, value, attention_mask, **kwargs)
    return dropping_the_last_key


def build_model(shape: tuple, layers: int, vocab: int, prompt: int, new: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, kv_heads, head_dim, hidden, mlp = shape
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=prompt + new + 8)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate(model, ids, new: int):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def timed_generate(model, ids, new: int, device: str) -> tuple[float, torch.Tensor]:
    sync(device)
    start = time.perf_counter()
    out = generate(model, ids, new)
    sync(device)
    return time.perf_counter() - start, out[:, ids.shape[1]:]


def forced_logits(model, ids, tokens, steps: int) -> torch.Tensor:
    """(steps, batch, vocab) fp32 logits of the decode steps fed ``tokens`` (teacher forcing)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1].float())
        for t in range(steps - 1):
            out = model(tokens[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits)


def step_profile(model, ids, device: str, out_path) -> dict:
    """Where PROFILE_STEPS decode steps' time goes, per step (ms): attention, GEMMs,
    other kernels, GPU idle (the host's share)."""
    from transformers import DynamicCache

    from attnlab.measure.end_to_end import profile_prefill

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)

    def steps():
        with torch.no_grad():
            for _ in range(PROFILE_STEPS):
                model(token, past_key_values=cache, use_cache=True)

    summary = profile_prefill(steps, device, out_path)
    per_step = {f"{name}_ms": ms / PROFILE_STEPS for name, ms in summary.class_ms.items()}
    return {**per_step, "attention_share": summary.attention_time_share,
            "profile_mode": summary.mode}


# ----- the greedy-token check -----------------------------------------------------------------
def greedy_check(reference: torch.Tensor, candidate: torch.Tensor, gap: torch.Tensor) -> dict:
    """Steps (step, sequence) where SDPA's top-1 leads by DECISION_FACTOR x ``gap``, and how
    many of them the candidate's argmax misses; and the steps where the candidate's logits
    stray from SDPA's by more than DECISION_FACTOR x ``gap`` anywhere in the vocabulary
    (a random model's near-tie logits decide few steps; its logits still say which
    implementation attends to what SDPA attends to)."""
    top = reference.topk(2, dim=-1).values
    margin = top[..., 0] - top[..., 1]
    decided = margin > DECISION_FACTOR * gap
    missed = decided & (candidate.argmax(-1) != reference.argmax(-1))
    strayed = (candidate - reference).abs().amax(-1) > DECISION_FACTOR * gap
    return {"decided": int(decided.sum()), "steps": decided.numel(),
            "mismatches": int(missed.sum()), "logit_outliers": int(strayed.sum())}


def reference_gap(logits: dict) -> torch.Tensor:
    """Per (step, sequence): the logit gap of two correct implementations."""
    if "eager" in logits:
        return (logits["eager"] - logits["sdpa"]).abs().amax(-1)
    return FALLBACK_RELATIVE_GAP * logits["sdpa"].abs().amax(-1)


# ----- the phase ------------------------------------------------------------------------------
@bench.phase("generate", cap_s=None, plan=points)
def generate_phase(ctx) -> list[dict]:
    """Each point: every provider's generate, its step profile and the greedy check."""
    settings = run_settings(ctx.args)
    device, rows = ctx.device, []
    names = register_providers(device)
    models: dict[str, object] = {}
    for shape_name, batch in ctx.within_budget(ctx.plan, label=lambda p: f"{p[0]} B{p[1]}"):
        shape = settings["shapes"][shape_name]
        if shape_name not in models:
            models.clear()
            if device == "cuda":
                torch.cuda.empty_cache()
            models[shape_name] = build_model(shape, settings["layers"], settings["vocab"],
                                             settings["prompt"], settings["new"], device)
        model = models[shape_name]
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(1, settings["vocab"], (batch, settings["prompt"]),
                            generator=gen).to(device)
        point = dict(shape=shape_name, batch=batch, heads=shape[0], kv_heads=shape[1],
                     head_dim=shape[2], layers=settings["layers"], prompt=settings["prompt"],
                     new_tokens=settings["new"])
        print(f"== {shape_name} B{batch} ({shape[0]}q/{shape[1]}kv d={shape[2]}, "
              f"{settings['layers']} layers, prompt {settings['prompt']}, "
              f"{settings['new']} new)", flush=True)
        point_rows, logits, tokens = [], {}, None
        for provider in PROVIDERS[1:2] + PROVIDERS[:1] + PROVIDERS[2:]:  # SDPA first
            row = dict(point, provider=provider)
            point_rows.append(row)
            if provider not in names:
                row["skipped"] = ("a pinned SDPA backend needs CUDA" if provider in SDPA_PINS
                                  else "flash-attn is not installed (transformers finds no "
                                       "flash_attention_2)")
                print(f"  {provider:18s} skipped: {row['skipped']}", flush=True)
                continue
            try:
                model.set_attn_implementation(names[provider])
                with pinned(provider):  # entered before the timed region
                    generate(model, ids, 2)  # warm: kernels compiled for these lengths
                    prefill_s, _ = timed_generate(model, ids, 1, device)
                    total_s, out = timed_generate(model, ids, settings["new"], device)
                    per_token_ms = (total_s - prefill_s) / (settings["new"] - 1) * 1e3
                    row.update(prefill_ms=prefill_s * 1e3, generate_ms=total_s * 1e3,
                               time_per_token_ms=per_token_ms,
                               tokens_per_s=batch / (per_token_ms / 1e3))
                    if provider == "sdpa":
                        tokens = out
                    if tokens is not None:
                        logits[provider] = forced_logits(model, ids[:, :CHECK_PROMPT], tokens,
                                                         settings["check_steps"])
                    row.update(step_profile(model, ids, device, ctx.path(
                        f"traces/{shape_name}_b{batch}_{provider}.json")))
                    print(f"  {provider:18s} {per_token_ms:8.2f} ms/token  "
                          f"{row['tokens_per_s']:9.1f} tok/s  prefill {prefill_s * 1e3:8.1f} ms  "
                          f"attention {row['attention_share']:.0%} of the step, "
                          f"GPU idle {row['idle_ms']:.2f} ms/step", flush=True)
            except Exception as error:  # noqa: BLE001 -- recorded, the run goes on
                if not isinstance(error, torch.cuda.OutOfMemoryError):
                    traceback.print_exc()
                row["skipped"] = f"{type(error).__name__}: {str(error)[:200]}"
                print(f"  {provider:18s} failed: {row['skipped']}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
        if "sdpa" in logits:
            try:
                judge_point(ctx, model, ids, tokens, logits, names, point_rows, settings)
            except Exception:  # noqa: BLE001 -- the timings stand; the check says it failed
                traceback.print_exc()
                ctx.fail()
        for row in point_rows:
            ctx.append_row("serving.jsonl", row)
        ctx.upsert("serving_records.jsonl", records_of(point_rows, point, ctx.env))
        rows += point_rows
    return rows


def judge_point(ctx, model, ids, tokens, logits, names, rows, settings) -> None:
    """The greedy check of every provider at one point, and of the sabotaged attnlab."""
    gap = reference_gap(logits)
    model.set_attn_implementation(names["sabotaged"])
    logits["sabotaged"] = forced_logits(model, ids[:, :CHECK_PROMPT], tokens,
                                        settings["check_steps"])
    sabotage = greedy_check(logits["sdpa"], logits["sabotaged"], gap)
    can_fail = sabotage["mismatches"] > 0 or sabotage["logit_outliers"] > 0
    for row in rows:
        if row["provider"] in logits and row["provider"] != "sdpa":
            check = greedy_check(logits["sdpa"], logits[row["provider"]], gap)
            wrong = check["mismatches"] or check["logit_outliers"]
            row["greedy"] = dict(check, sabotaged_mismatches=sabotage["mismatches"],
                                 sabotaged_logit_outliers=sabotage["logit_outliers"],
                                 verdict=("match" if not wrong else "MISMATCH")
                                 if can_fail else "cannot judge (the sabotage passed too)")
            if wrong and can_fail and row["provider"] == "attnlab":
                ctx.fail()
            print(f"  greedy {row['provider']:11s} {check['mismatches']} of {check['decided']} "
                  f"decided steps differ from SDPA, logits stray at {check['logit_outliers']} "
                  f"of {check['steps']} steps (the sabotaged attnlab: {sabotage['mismatches']}, "
                  f"{sabotage['logit_outliers']}): {row['greedy']['verdict']}", flush=True)


def records_of(rows, point, env) -> list[dict]:
    """Contract records (phase decode): time per token of each provider at ``point``."""
    from attnlab.measure import records
    from attnlab.shapes import AttentionShape

    shape = AttentionShape(batch=point["batch"], query_heads=point["heads"],
                           kv_heads=point["kv_heads"], seqlen_q=1,
                           seqlen_k=point["prompt"] + point["new_tokens"],
                           head_dim=point["head_dim"], dtype="bf16", causal=True)
    out = []
    for row in rows:
        name = f"hf_{row['provider']}"
        if "skipped" in row:
            out.append(records.skipped_record(provider=name, phase="decode", shape=shape,
                                              reason=row["skipped"], env=env,
                                              kernel="generate_step"))
            continue
        value = row["time_per_token_ms"]
        out.append(records.make_record(
            kernel="generate_step", provider=name, phase="decode", shape=shape,
            metric="time_per_token", unit="ms", p20=value, p50=value, p80=value, repeats=1,
            env=env, timing_method=f"(generate {point['new_tokens']} - generate 1) / "
                                   f"{point['new_tokens'] - 1}, {point['layers']} layers, "
                                   "transformers DynamicCache"))
    return out


@bench.finish
def print_table(ctx) -> None:
    rows = ctx.results.get("generate") or []
    if not rows:
        return
    print("\nshape, batch | provider | ms/token | tokens/s | attention / GEMM / other / idle "
          "ms per step | greedy check")
    for row in rows:
        head = f"{row['shape']} B{row['batch']} | {row['provider']}"
        if "skipped" in row:
            print(f"{head} | skipped: {row['skipped'][:80]}")
            continue
        greedy = row.get("greedy")
        check = ("reference" if row["provider"] == "sdpa" else
                 f"{greedy['verdict']} ({greedy['mismatches']}/{greedy['decided']})"
                 if greedy else "-")
        print(f"{head} | {row['time_per_token_ms']:.2f} | {row['tokens_per_s']:.0f} | "
              f"{row['attention_ms']:.2f} / {row['gemm_ms']:.2f} / {row['other_ms']:.2f} / "
              f"{row['idle_ms']:.2f} | {check}")


if __name__ == "__main__":
    sys.exit(bench.main())
