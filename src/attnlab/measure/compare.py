"""Predicted vs measured DRAM bytes, side by side: logical model, cache-aware model, ncu.

A case is one provider call on one shape; its measured kernels come from ncu (the
kernels inside the case's NVTX range), its predictions from
:mod:`attnlab.model.cache` and the logical model.  Kernels are matched to
predictions by role (GEMM, scale, mask, softmax, attention, split, combine) in
launch order, after back-to-back launches of one elementwise kernel (a pass split
into 32-bit-indexable chunks) are summed into one; measured kernels the provider's
model does not contain (e.g. the
mask *construction* of an eager call that builds its mask inside the call) are
listed and left out of the compared total, never silently.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from attnlab.measure.ncu import NcuKernel
from attnlab.measure.profile import is_gemm
from attnlab.model import cache as cache_model
from attnlab.model import l2 as l2_model
from attnlab.shapes import AttentionShape

# The goal of issue 5: the cache-aware estimate within 15% of measured DRAM bytes.
GOAL_RELATIVE_ERROR = 0.15

_ROLE_PATTERNS = (
    ("backward_dkdv", re.compile(r"_attn_bwd_dkdv")),
    ("backward_dq", re.compile(r"_attn_bwd_dq")),
    ("combine", re.compile(r"combine", re.I)),
    ("split_kv", re.compile(r"splitkv|split_kv", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attn|attention|cudnn", re.I)),
    ("scale", re.compile(r"MulFunctor", re.I)),
    ("mask", re.compile(r"masked_fill", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
    ("mask_build", re.compile(r"FillFunctor|triu_tril|bitwise_not", re.I)),
)


# Roles whose kernels run whole, however large the call: never merged as chunks.
_NEVER_CHUNKED = frozenset({"backward_dkdv", "backward_dq", "split_kv", "combine"})


# The decode API's providers and the cache each stores, as the byte model takes it
# (measure.providers: attnlab_decode_fp8 quantises per (batch, KV head); the paged one
# holds the same rows in 16-token pages).
DECODE_API_CACHES: dict[str, dict] = {
    "attnlab_decode": {},
    "attnlab_decode_paged16": {"page_size": 16},
    "attnlab_decode_fp8": {"kv_dtype": "fp8", "kv_scales": "kv-head"},
}
# Providers the cache model predicts: the peers from their shape, attnlab's from its
# kernels' tile configurations for the shape (the model itself never imports kernels).
PREDICTED_PROVIDERS = (*cache_model.PREDICTORS, "attnlab", *DECODE_API_CACHES)


def decode_launch(provider: str, shape: AttentionShape,
                  hw: cache_model.CacheHardware = cache_model.H200) -> tuple[int, dict] | None:
    """(split count, cache storage) when ``provider``'s call runs attnlab's split-KV decode
    kernel -- the decode API's always, ``attnlab``'s when the API routes it there (short
    queries against a long cache) -- else None.  The count is the launcher's for the
    cache's dtype: an fp8 cache has a tiling of its own, so a split count of its own."""
    from attnlab.kernels.decode import launch_plan
    from attnlab.kernels.dispatch import routes_to_decode

    if provider in DECODE_API_CACHES:
        cache = DECODE_API_CACHES[provider]
    elif provider == "attnlab" and routes_to_decode(seqlen_q=shape.seqlen_q,
                                                    seqlen_k=shape.seqlen_k, needs_grad=False):
        cache = {}
    else:
        return None
    plan = launch_plan(batch=shape.batch, kv_heads=shape.kv_heads, query_heads=shape.query_heads,
                       seqlen_q=shape.seqlen_q, seqlen_k=shape.seqlen_k,
                       head_dim=shape.head_dim, sm_count=hw.sm_count,
                       fp8_cache=cache.get("kv_dtype") == "fp8")
    return plan["num_splits"], cache


def predict(provider: str, shape: AttentionShape,
            hw: cache_model.CacheHardware = cache_model.H200) -> list[cache_model.PredictedKernel]:
    """The cache model's kernels for one provider call, in launch order."""
    launch = decode_launch(provider, shape, hw)
    if launch is not None:
        splits, cache = launch
        # The decode API writes an LSE only when asked (the providers do not ask);
        # ``attnlab``'s decode route does.
        return cache_model.predict_attnlab_decode(shape, splits, hw,
                                                  writes_lse=provider == "attnlab", **cache)
    if provider == "attnlab":
        from attnlab.kernels.configs import forward_config, head_dim_padded

        config = forward_config(shape)
        return cache_model.predict_attnlab(
            shape, hw, block_m=config.block_m, block_n=config.block_n,
            num_warps=config.num_warps, num_stages=config.num_stages,
            head_dim_padded=head_dim_padded(shape.head_dim))
    if provider not in cache_model.PREDICTORS:
        raise ValueError(f"the cache model covers providers {', '.join(PREDICTED_PROVIDERS)}; "
                         f"got {provider!r}")
    return cache_model.predict(provider, shape, hw)


def attnlab_backward_plan(shape: AttentionShape,
                          hw: cache_model.CacheHardware = cache_model.H200) -> dict:
    """What attnlab's backward launches for ``shape``, as the models take it: the traffic
    variant (``"attnlab-sm90"`` where the Gluon dK/dV kernel's dispatch table takes the
    bucket), each kernel's (query rows, key rows) tiles, and their cache-model tilings
    (launch sizes estimated from the configs: threads, a register count at the cap the
    warps allow, the tiles' shared memory).  The Gluon kernel's launches (``gluon``) carry
    its real layout: ``Sm90BackwardConfig.launches`` (at d = 256 the dV launch, then the dK
    launch, each with its own query tiles), ``dispatch.dkdv_schedule``'s program order and
    head split on ``hw``'s SMs (one schedule for every launch of a call, as
    ``kernels/backward.py`` asks it once), ``BLOCK_N`` keys a program."""
    from attnlab.kernels._compat import gluon_refusal
    from attnlab.kernels.configs import backward_config, head_dim_padded, length_bucket

    config = backward_config(shape)
    d_pad = head_dim_padded(shape.head_dim)
    b = shape.element_bytes

    def launch(warps, shared):
        registers = min(255, 65536 // (32 * warps) // 8 * 8)
        return cache_model.Launch(32 * warps, registers, shared)

    sm90 = None
    if gluon_refusal() is None and not shape.has_window:
        from attnlab.kernels.dispatch import DKDV_SM90

        bucket = length_bucket(max(shape.seqlen_q, shape.seqlen_k))
        sm90 = DKDV_SM90.table().get((shape.head_dim, shape.causal, bucket))
    dq_tiles = (config.dq_block_m, config.dq_block_n)
    dq = cache_model.FusedTiling(*dq_tiles, launch(
        config.num_warps,
        (2 * config.dq_block_m + 2 * config.num_stages * config.dq_block_n) * d_pad * b))
    if sm90 is None:
        dkdv_tiles = (config.dkdv_block_m, config.dkdv_block_n)
        dkdv = cache_model.FusedTiling(*dkdv_tiles, launch(
            config.num_warps, (2 * config.dkdv_block_n + 2 * config.num_stages
                               * config.dkdv_block_m) * d_pad * b))
        return {"variant": "attnlab", "dq_tiles": dq_tiles, "dkdv_tiles": dkdv_tiles,
                "dv_tiles": None, "dq": dq, "dkdv": dkdv, "gluon": (), "schedule": None,
                "config": config.as_dict(), "sm90": None}
    gluon, schedule = _gluon_launches(shape, sm90, hw)
    # The traffic model's tiles: the dK (or dK/dV) launch's, and the dV launch's apart.
    tiles = {launch.forms_dk: (launch.order.block_m, launch.order.block_n) for launch in gluon}
    return {"variant": "attnlab-sm90", "dq_tiles": dq_tiles, "dkdv_tiles": tiles[True],
            "dv_tiles": tiles.get(False), "dq": dq, "dkdv": None, "gluon": gluon,
            "schedule": schedule, "config": config.as_dict(), "sm90": sm90.name()}


def _gluon_launches(shape: AttentionShape, sm90, hw: cache_model.CacheHardware
                    ) -> tuple[tuple[cache_model.GluonDkdvLaunch, ...], dict]:
    """The Gluon dK/dV launches of ``sm90`` (a ``Sm90BackwardConfig``) for ``shape``, and
    the schedule they run in, as the cache model takes them."""
    from attnlab.kernels import backward_sm90
    from attnlab.kernels.dispatch import dkdv_schedule

    schedule = dkdv_schedule(batch=shape.batch, kv_heads=shape.kv_heads,
                             group_size=shape.group_size, seqlen_q=shape.seqlen_q,
                             seqlen_k=shape.seqlen_k, causal=shape.causal,
                             block_m=sm90.block_m, block_n=backward_sm90.BLOCK_N,
                             sm_count=hw.sm_count)
    warps = 3 * backward_sm90.CONSUMER_WARPS  # two consumer warpgroups and the producer's
    registers = min(255, 65536 // (32 * warps) // 8 * 8)
    launches = tuple(
        cache_model.GluonDkdvLaunch(
            form_dk, form_dv,
            l2_model.KeyBlockOrder(backward_sm90.BLOCK_N, block_m, schedule.block_major,
                                   schedule.head_split),
            cache_model.Launch(32 * warps, registers, backward_sm90.launch_shared_memory_bytes(
                shape.head_dim, form_dk, block_m, stages, shape.element_bytes)))
        for form_dk, form_dv, block_m, stages in sm90.launches(shape.head_dim))
    return launches, {"block_major": schedule.block_major, "head_split": schedule.head_split}


def predict_backward(shape: AttentionShape, hw: cache_model.CacheHardware = cache_model.H200
                     ) -> list[cache_model.PredictedKernel]:
    """The cache model's attnlab backward kernels for ``shape``: dQ, then dK/dV -- the
    Triton kernel's launch, or the Gluon kernel's (at d = 256 its dV launch and its dK
    launch, their row re-reads replayed through the fitted LRU L2)."""
    plan = attnlab_backward_plan(shape, hw)
    dq = cache_model.predict_attnlab_dq(shape, hw, dq=plan["dq"],
                                        lse_log2=plan["variant"] == "attnlab-sm90")
    if plan["gluon"]:
        return [dq, *cache_model.predict_gluon_dkdv(shape, hw, launches=plan["gluon"])]
    return [dq, cache_model.predict_triton_dkdv(shape, hw, dkdv=plan["dkdv"],
                                                split=_split_dkdv(plan))]


def _split_dkdv(plan: dict) -> bool:
    """Whether the plan forms dK and dV apart: two programs per key block (the Triton
    kernel's ``BackwardConfig.dkdv_split``) or two Gluon launches (its dV launch's tiles
    in the plan's ``dv_tiles``)."""
    if plan["sm90"] is not None:
        return plan["dv_tiles"] is not None
    return plan["config"]["dkdv_split"]


def logical_backward(shape: AttentionShape):
    """The logical traffic model of attnlab's backward for ``shape`` (scope: the layer)."""
    from attnlab.model import traffic

    plan = attnlab_backward_plan(shape)
    return traffic.backward_traffic(shape, variant=plan["variant"], scope="layer",
                                    dq_tiles=plan["dq_tiles"], dkdv_tiles=plan["dkdv_tiles"],
                                    dkdv_split=_split_dkdv(plan), dv_tiles=plan["dv_tiles"])


def predicted_kernel_count(provider: str, shape: AttentionShape) -> int | None:
    """Kernels the cache model predicts one call launches; None for an unmodelled provider."""
    return len(predict(provider, shape)) if provider in PREDICTED_PROVIDERS else None


def kernel_role(name: str, gemm_index: int = 0) -> str:
    """What a measured kernel does, from its name; GEMMs by launch order (QK^T, then PV)."""
    if is_gemm(name):
        return "gemm_qk" if gemm_index == 0 else "gemm_pv"
    for role, pattern in _ROLE_PATTERNS:
        if pattern.search(name):
            return role
    return "other"


def measured_roles(kernels: Sequence[NcuKernel]) -> list[str]:
    roles, gemms = [], 0
    for kernel in kernels:
        role = kernel_role(kernel.name, gemms)
        gemms += role.startswith("gemm")
        roles.append(role)
    return roles


@dataclass
class KernelPair:
    role: str
    measured: NcuKernel | None
    predicted: cache_model.PredictedKernel | None

    @property
    def measured_bytes(self) -> int | None:
        """DRAM bytes read + written; None when ncu did not see the kernel (or its reads)."""
        if self.measured is None or self.measured.dram_bytes_read is None:
            return None
        return self.measured.dram_bytes_read + (self.measured.dram_bytes_write or 0)

    @property
    def relative_error(self) -> float | None:
        """(predicted - measured) / measured; None without both sides (or measured 0)."""
        measured = self.measured_bytes
        if self.predicted is None or not measured:
            return None
        return (self.predicted.total_bytes - measured) / measured

    @property
    def meets_goal(self) -> bool:
        error = self.relative_error
        return error is not None and abs(error) <= GOAL_RELATIVE_ERROR

    def as_row(self) -> dict:
        m, p = self.measured, self.predicted
        return {"role": self.role, "measured": None if m is None else m.name,
                "measured_read_bytes": None if m is None else m.dram_bytes_read,
                "measured_write_bytes": None if m is None else m.dram_bytes_write,
                "measured_bytes": self.measured_bytes,
                "duration_ns": None if m is None else m.duration_ns,
                "predicted": None if p is None else p.as_dict(),
                "predicted_bytes": None if p is None else p.total_bytes,
                "relative_error": self.relative_error, "within_goal": self.meets_goal}


@dataclass
class CaseComparison:
    provider: str
    shape: AttentionShape
    pairs: list[KernelPair]
    logical_bytes: int | None
    logical_note: str
    unmodelled: list[NcuKernel] = field(default_factory=list)

    @property
    def measured_read(self) -> int:
        return sum(p.measured.dram_bytes_read or 0 for p in self.pairs if p.measured)

    @property
    def measured_write(self) -> int:
        return sum(p.measured.dram_bytes_write or 0 for p in self.pairs if p.measured)

    @property
    def measured_total(self) -> int:
        return self.measured_read + self.measured_write

    @property
    def predicted_read(self) -> int:
        return sum(p.predicted.read_bytes for p in self.pairs if p.predicted)

    @property
    def predicted_write(self) -> int:
        return sum(p.predicted.write_bytes for p in self.pairs if p.predicted)

    @property
    def predicted_total(self) -> int:
        return self.predicted_read + self.predicted_write

    @property
    def relative_error(self) -> float | None:
        """(predicted - measured) / measured, over the kernels both sides contain; None
        when ncu measured no DRAM bytes for them (nothing to be relative to)."""
        if self.measured_total == 0:
            return None
        return (self.predicted_total - self.measured_total) / self.measured_total

    @property
    def logical_relative_error(self) -> float | None:
        if self.logical_bytes is None or self.measured_total == 0:
            return None
        return (self.logical_bytes - self.measured_total) / self.measured_total

    @property
    def kernel_pairs(self) -> list[KernelPair]:
        """Every kernel of the case: the predicted ones, measured or not, then the measured
        ones the model lacks (no prediction)."""
        return [*self.pairs, *(KernelPair(kernel_role(k.name), k, None) for k in self.unmodelled)]

    @property
    def kernels_match(self) -> bool:
        return all(p.measured is not None and p.predicted is not None for p in self.pairs)

    @property
    def meets_goal(self) -> bool:
        error = self.relative_error
        return self.kernels_match and error is not None and abs(error) <= GOAL_RELATIVE_ERROR

    def as_dict(self) -> dict:
        return {
            "provider": self.provider, "shape": self.shape.as_dict(),
            "measured_read_bytes": self.measured_read,
            "measured_write_bytes": self.measured_write,
            "predicted_read_bytes": self.predicted_read,
            "predicted_write_bytes": self.predicted_write,
            "relative_error": self.relative_error, "meets_goal": self.meets_goal,
            "kernels_match": self.kernels_match,
            "logical_bytes": self.logical_bytes, "logical_note": self.logical_note,
            "logical_relative_error": self.logical_relative_error,
            "kernels": [p.as_row() for p in self.pairs],
            "unmodelled_kernels": [k.name for k in self.unmodelled],
        }


_SUMMED_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")


def merge_chunked_launches(kernels: Sequence[NcuKernel]) -> list[NcuKernel]:
    """One pass that PyTorch split into several launches of the same kernel, as one kernel.

    An elementwise pass over more than 2^31 elements (eager's scale of a 16 GiB score
    matrix) runs as several launches of one kernel, one per 32-bit-indexable chunk; the
    model counts the pass once, so the chunks' bytes and times are added up.
    Attention kernels are never chunked (attnlab's offsets are 64-bit): back-to-back
    launches of one (the Gluon dK/dV kernel's dV and dK launches at d = 256) stay apart.
    """
    merged: list[NcuKernel] = []
    for kernel in kernels:
        last = merged[-1] if merged else None
        if (last is not None and last.name == kernel.name and not is_gemm(kernel.name)
                and kernel_role(kernel.name) not in _NEVER_CHUNKED):
            metrics = dict(last.metrics)
            for metric in _SUMMED_METRICS:
                if metric in last.metrics and metric in kernel.metrics:
                    value, unit = last.metrics[metric]
                    metrics[metric] = (value + kernel.metrics[metric][0], unit)
            merged[-1] = replace(last, metrics=metrics)
        else:
            merged.append(kernel)
    return merged


def compare_case(provider: str, shape: AttentionShape, kernels: Sequence[NcuKernel],
                 hw: cache_model.CacheHardware = cache_model.H200, *,
                 phase: str = "prefill") -> CaseComparison:
    """Pair a case's measured kernels with the cache model's prediction, role by role.

    ``phase`` is the case label's: a fwd+bwd case (attnlab's only) adds the backward's
    dQ and dK/dV kernels to the forward's, in the prediction and the logical bytes."""
    from attnlab.measure.ncu import FWDBWD_PHASE

    training = phase == FWDBWD_PHASE
    if training and provider != "attnlab":
        raise ValueError(f"the backward's cache model covers provider 'attnlab' only, "
                         f"not {provider!r}")
    predicted = predict(provider, shape, hw) + (predict_backward(shape, hw) if training else [])
    kernels = merge_chunked_launches(kernels)
    roles = measured_roles(kernels)
    pairs: list[KernelPair] = []
    unmodelled: list[NcuKernel] = []
    remaining = list(zip(roles, kernels, strict=True))
    for prediction in predicted:
        index = next((i for i, (role, _) in enumerate(remaining) if role == prediction.role),
                     None)
        if index is None:
            pairs.append(KernelPair(prediction.role, None, prediction))
            continue
        role, kernel = remaining.pop(index)
        pairs.append(KernelPair(role, kernel, prediction))
    unmodelled = [kernel for _, kernel in remaining]
    launch = decode_launch(provider, shape, hw)
    try:
        if launch is None:
            logical, note = cache_model.logical_bytes(provider, shape, hw)
        else:  # the decode API's providers run attnlab's decode kernel too
            splits, cache = launch
            logical, note = cache_model.logical_bytes("attnlab", shape, hw,
                                                      attnlab_decode_splits=splits,
                                                      kv_dtype=cache.get("kv_dtype"))
    except ValueError as error:  # a shape the logical model does not cover
        logical, note = None, f"logical model unavailable: {error}"
    if training and logical is not None:
        logical += logical_backward(shape).total_bytes
        note += "; the backward's dQ and dK/dV passes"
    return CaseComparison(provider, shape, pairs, logical, note, unmodelled)


def _mb(value: int | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value / 1e6:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f}%"


def markdown_table(comparisons: Sequence[CaseComparison]) -> str:
    """The predicted-vs-measured table (MB = 10^6 bytes, DRAM, one call, all heads)."""
    lines = [
        "| provider | shape | kernels | measured R / W (MB) | cache-aware R / W (MB) | "
        "cache-aware error | logical (MB) | logical error | within 15% |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        kernels = " + ".join(p.role for p in c.pairs)
        if c.unmodelled:
            kernels += f" (not modelled: {len(c.unmodelled)})"
        lines.append(
            f"| {c.provider} | {c.shape.describe()} | {kernels} | "
            f"{_mb(c.measured_read)} / {_mb(c.measured_write)} | "
            f"{_mb(c.predicted_read)} / {_mb(c.predicted_write)} | {_pct(c.relative_error)} | "
            f"{_mb(c.logical_bytes)} | {_pct(c.logical_relative_error)} | "
            f"{'yes' if c.meets_goal else 'NO'} |")
    return "\n".join(lines) + "\n"


def kernel_rows(comparisons: Sequence[CaseComparison]) -> list[dict]:
    """One row per kernel of every case (:attr:`CaseComparison.kernel_pairs`): the case,
    measured and predicted DRAM bytes, the relative error, whether it is within the goal."""
    return [{"provider": c.provider, "shape": c.shape.as_dict(), **pair.as_row()}
            for c in comparisons for pair in c.kernel_pairs]


def kernel_markdown_table(comparisons: Sequence[CaseComparison]) -> str:
    """The per-kernel predicted-vs-measured table (MB = 10^6 bytes, DRAM, one launch)."""
    lines = ["| provider | shape | kernel | measured R / W (MB) | cache-aware R / W (MB) | "
             "error | within 15% |", "|---|---|---|---|---|---|---|"]
    for c in comparisons:
        for pair in c.kernel_pairs:
            m, p = pair.measured, pair.predicted
            missing = " (not measured)" if m is None else " (not modelled)" if p is None else ""
            lines.append(
                f"| {c.provider} | {c.shape.describe()} | {pair.role}{missing} | "
                f"{_mb(m and m.dram_bytes_read, 2)} / {_mb(m and m.dram_bytes_write, 2)} | "
                f"{_mb(p and p.read_bytes, 2)} / {_mb(p and p.write_bytes, 2)} | "
                f"{_pct(pair.relative_error)} | {'yes' if pair.meets_goal else 'NO'} |")
    return "\n".join(lines) + "\n"


# ----- a whole ncu run: every case compared, and its counters as records ---------------------
COMPARISON_HEADER = ("Predicted (cache-aware model) vs measured (ncu --clock-control none) DRAM "
                     "bytes of one call; MB = 10^6 bytes.\n\n")


def compare_cases(kernels: Sequence[NcuKernel],
                  hw: cache_model.CacheHardware = cache_model.H200) -> list[CaseComparison]:
    """One comparison per attnlab case label among ``kernels`` whose provider is predicted.

    A foreign label (e.g. the peer anchors' ranges) has no shape to predict from and is
    left out, as is a provider the cache model does not cover.
    """
    from attnlab.measure.ncu import group_by_case, join_preceding_case, parse_case_label

    comparisons = []
    for label, case_kernels in group_by_case(join_preceding_case(list(kernels))).items():
        try:
            provider, phase, shape = parse_case_label(label)
        except (ValueError, KeyError, StopIteration):
            continue
        if provider in PREDICTED_PROVIDERS:
            comparisons.append(compare_case(provider, shape, case_kernels, hw, phase=phase))
    return comparisons


def comparison_markdown(comparisons: Sequence[CaseComparison]) -> str:
    """The committed ``cache_model_vs_ncu.md``: a one-line header and the table."""
    return COMPARISON_HEADER + markdown_table(comparisons)


def ncu_records(kernels: Sequence[NcuKernel], env: dict) -> list[dict]:
    """DRAM bytes read, written and the duration of every kernel, as bench records."""
    from attnlab.measure import records as rec
    from attnlab.measure.ncu import group_by_case, parse_case_label
    from attnlab.measure.profile import short_name

    out = []
    for label, case_kernels in group_by_case(kernels).items():
        try:
            provider, phase, shape = parse_case_label(label)
        except (ValueError, KeyError, StopIteration):
            continue
        for index, k in enumerate(case_kernels):
            name = f"{index}:{short_name(k.name, 120)}"
            for metric, unit, value in (("dram_bytes_read", "byte", k.dram_bytes_read),
                                        ("dram_bytes_write", "byte", k.dram_bytes_write),
                                        ("duration", "ns", k.duration_ns)):
                if value is not None:
                    out.append(rec.make_record(
                        kernel=name, provider=provider, phase=phase, shape=shape, metric=metric,
                        unit=unit, p20=value, p50=value, p80=value, repeats=1, env=env,
                        kernel_names=[k.name]))
    return out
