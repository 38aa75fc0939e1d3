"""Which tiles ptxas can build, on this machine's Triton, without a GPU.

    PYTHONPATH=/work/tritons/t3.6.0:src python3 bench/ptxas_configs.py --out OUT.jsonl [--jobs 2]
        [--head-dims 8,16,...] [--variants plain|pairwise|all] [--candidates]
        [--kernels triton-forward,triton-backward,gluon-forward,gluon-dkdv]

Compiles for sm_90a (``kernels/_aot``), for every head dim from 8 to 256 in steps of 8 and
the odd ones the tests claim (59, 111), every kernel and config the dispatcher can choose
on sm_90: the Triton forward (``configs.forward_choices``), the Triton dK/dV and dQ
(``configs.backward_choices``; the dQ kernel also as it feeds the Gluon dK/dV kernel), and
the Gluon forward and dK/dV kernels at their dispatch tables' configs and defaults.  Each
config is built in variants of dtype x mask (none / causal / two-sided window) x softcap x
varlen: ``--variants plain`` the two a plain training call takes (fp16 unmasked, bf16
causal), ``pairwise`` (default) a covering set with every pair of two factors' values in
some variant plus the plain causal call, ``all`` all 24.  Builds already in ``--out`` are
skipped (a stopped sweep resumes).  One JSON line per kernel
build, flushed as it comes: built or the error, registers, stack bytes and LDL/STL count
(spills).  The last lines print the failures and the spilling configs.  ``--candidates``
builds ``CANDIDATES`` (other backward tiles) instead, to find ones that build.

Triton 3.6.0's ptxas died (SIGSEGV) on two-stage dQ tiles at head_dim 16/32 (bench/NOTES.md,
B15); the chosen configs must pass here on every supported Triton, and a config that fails
is listed in ``configs.PTXAS_FAILURES`` (tests/test_ptxas_configs.py checks the tables
never choose one).  A build takes 2-20 s of one core (the spilling d = 256 tiles the
longest): ``--variants plain`` over every head dim is ~340 builds per Triton; ``--jobs``
runs builds side by side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import MISSING, asdict, fields

import triton

from attnlab.kernels.configs import BackwardConfig, backward_choices, forward_choices

HEAD_DIMS = (*range(8, 257, 8), 59, 111)
MASKS = ("none", "causal", "window")
# (dtype, mask, softcap, varlen): every pair of two factors' values appears in some row;
# the last is the plain causal training call.
PAIRWISE = (("bf16", "none", False, False), ("fp16", "none", True, True),
            ("bf16", "causal", True, True), ("fp16", "causal", False, False),
            ("bf16", "window", False, True), ("fp16", "window", True, False),
            ("bf16", "causal", False, False))
ALL_VARIANTS = tuple(itertools.product(("bf16", "fp16"), MASKS, (False, True), (False, True)))
# The two configs a plain training call takes (masked and not), in one dtype each.
PLAIN = (("fp16", "none", False, False), ("bf16", "causal", False, False))
VARIANTS = {"plain": PLAIN, "pairwise": PAIRWISE, "all": ALL_VARIANTS}
KERNELS = ("triton-forward", "triton-backward", "gluon-forward", "gluon-dkdv")
CANDIDATES = (BackwardConfig(64, 128, 128, 64, 8, 2), BackwardConfig(64, 128, 128, 128, 8, 2),
              BackwardConfig(64, 128, 128, 64, 8, 1), BackwardConfig(64, 128, 128, 64, 4, 2),
              BackwardConfig(64, 64, 64, 64, 4, 2), BackwardConfig(32, 64, 64, 32, 4, 1),
              BackwardConfig(32, 64, 64, 64, 8, 1))


def triton_tasks(kernels, head_dims, variants, candidates: bool) -> list[tuple]:
    """(kernel, head_dim, config, variant options) of each Triton kernel build."""
    tasks = []
    for head_dim, (dtype, mask, softcap, varlen) in itertools.product(head_dims, variants):
        options = dict(dtype=dtype, causal=mask == "causal", window=mask == "window",
                       softcap=softcap, varlen=varlen)
        masked = mask != "none"
        if "triton-backward" in kernels:
            configs = CANDIDATES if candidates else backward_choices(head_dim, masked)
            for config, name in itertools.product(configs, ("dkdv", "dq")):
                tasks.append((f"triton-{name}", head_dim, config, options))
            # The dQ kernel writes LSE in log2 units where the Gluon dK/dV kernel runs.
            if head_dim in (64, 128) and mask != "window" and not (softcap or varlen):
                for config in configs:
                    tasks.append(("triton-dq", head_dim, config,
                                  dict(options, write_lse_log2=True)))
        if "triton-forward" in kernels and not candidates:
            for config in forward_choices(head_dim, masked):
                tasks.append(("triton-forward", head_dim, config, options))
                if (dtype, mask, softcap, varlen) == variants[-1]:  # 64-bit tile offsets
                    tasks.append(("triton-forward", head_dim, config,
                                  dict(options, offsets_64=True)))
    return tasks


def gluon_tasks(kernels, head_dims) -> list[tuple]:
    """The Gluon kernels at every config their tables and defaults name."""
    from attnlab.kernels._compat import gluon_refusal

    if gluon_refusal() is not None:
        print(f"Gluon kernels skipped: {gluon_refusal()}", flush=True)
        return []
    from attnlab.kernels import backward_sm90, forward_sm90
    from attnlab.kernels.dispatch import DKDV_SM90, FORWARD_SM90

    tasks = []
    for name, module, table in (("gluon-forward", forward_sm90, FORWARD_SM90.table()),
                                ("gluon-dkdv", backward_sm90, DKDV_SM90.table())):
        if name not in kernels:
            continue
        chosen = {(d, c, config) for (d, c, _), config in table.items()}
        chosen |= {(d, c, config) for d, config in module.DEFAULT_CONFIGS.items()
                   for c in (False, True)}
        for (head_dim, causal, config), dtype in itertools.product(sorted(chosen, key=str),
                                                                   ("bf16", "fp16")):
            if head_dim not in head_dims:
                continue
            # A one-gradient head dim's dK/dV is two kernels: the dV launch and the dK one.
            forms = (("dv", "dk") if name == "gluon-dkdv"
                     and head_dim in backward_sm90.ONE_GRADIENT_PER_LAUNCH else (None,))
            for form in forms:
                options = dict(dtype=dtype, causal=causal, **({"form": form} if form else {}))
                tasks.append((name, head_dim, config, options))
    return tasks


def build_row(task: tuple) -> dict:
    """What a build's JSON line says of the build itself."""
    kernel, head_dim, config, options = task
    return {"triton": triton.__version__, "kernel": kernel, "head_dim": head_dim,
            "config": {"type": type(config).__name__, **asdict(config)}, **options}


def build_key(row: dict) -> str:
    """What makes two JSON lines the same build (a resumed sweep skips it).  A config
    field at its default is left out, so a line written before the field existed is the
    same build as one written after."""
    key = {k: v for k, v in row.items() if k in _BUILD_FIELDS or k in (
        "write_lse_log2", "offsets_64")}
    config = dict(key.get("config", {}))
    defaults = _CONFIG_DEFAULTS.get(config.get("type"), {})
    key["config"] = {k: v for k, v in config.items() if k not in defaults or defaults[k] != v}
    return json.dumps(key, sort_keys=True)


def _defaults(cls) -> dict:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


_CONFIG_DEFAULTS = {cls.__name__: _defaults(cls) for cls in (BackwardConfig,)}
_BUILD_FIELDS = ("triton", "kernel", "head_dim", "config", "dtype", "causal", "window",
                 "softcap", "varlen", "form")


def read_rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def build(task: tuple, describe=None) -> dict:
    """One kernel build's JSON line; ``describe(compiled)`` adds fields of its own to a
    build that succeeded (``bench/backward_d256_tiles.py``: the MMAs and shared memory)."""
    from attnlab.kernels import backward, forward
    from attnlab.kernels._aot import resource_usage

    kernel, head_dim, config, options = task
    row = build_row(task)
    start = time.perf_counter()
    try:
        if kernel == "triton-forward":
            compiled = forward.compile_for_sm90(head_dim, config, **options)
        elif kernel in ("triton-dkdv", "triton-dkdv-split", "triton-dq"):
            # The split dK/dV kernel is the dK/dV kernel of a config with dkdv_split.
            compiled, = backward.compile_for_sm90(
                head_dim, config, **options,
                kernels=("dq" if kernel == "triton-dq" else "dkdv",))
        elif kernel == "gluon-forward":
            from attnlab.kernels import forward_sm90
            compiled = forward_sm90.compile_for_sm90(head_dim, config, **options)
        else:
            from attnlab.kernels import backward_sm90
            compiled = backward_sm90.compile_for_sm90(head_dim, config, **options)
    except Exception as error:  # ptxas's crash is a PTXASError; record any failure
        first_line = (str(error).strip().splitlines() or [""])[0]
        return {**row, "built": False, "error": f"{type(error).__name__}: {first_line}"[:300],
                "seconds": round(time.perf_counter() - start, 1)}
    return {**row, "built": True, **(resource_usage(compiled.asm["cubin"]) or {}),
            **(describe(compiled) if describe else {}),
            "seconds": round(time.perf_counter() - start, 1)}


def summary(rows: list[dict]) -> list[str]:
    """The failures, then per (kernel, head dim, config) the worst spill seen."""
    lines = [f"FAIL {r['kernel']} d={r['head_dim']} {r['config']} "
             f"{ {k: v for k, v in r.items() if k in ('dtype', 'causal', 'window', 'softcap', 'varlen')} }"
             f": {r['error']}" for r in rows if not r["built"]]
    worst: dict[tuple, dict] = {}
    for r in rows:
        if r["built"] and r.get("local_memory_ops"):
            key = (r["kernel"], r["head_dim"], json.dumps(r["config"]))
            if r["local_memory_ops"] > worst.get(key, {}).get("local_memory_ops", 0):
                worst[key] = r
    lines.append(f"{'kernel':<15} {'d':>4} {'LDL/STL':>8} {'stack B':>8}  config")
    for (kernel, head_dim, config), r in sorted(worst.items()):
        lines.append(f"{kernel:<15} {head_dim:>4} {r['local_memory_ops']:>8} "
                     f"{r['stack_bytes']:>8}  {config}")
    built = sum(r["built"] for r in rows)
    lines.append(f"triton {triton.__version__}: {built} of {len(rows)} built, "
                 f"{len(worst)} (kernel, head dim, config) spill")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines file (appended)")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--variants", choices=tuple(VARIANTS), default="pairwise")
    parser.add_argument("--candidates", action="store_true")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    head_dims = tuple(int(d) for d in args.head_dims.split(","))
    kernels = tuple(args.kernels.split(","))
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        parser.error(f"--kernels must name some of {', '.join(KERNELS)}, got {sorted(unknown)}")
    tasks = triton_tasks(kernels, head_dims, VARIANTS[args.variants], args.candidates)
    if not args.candidates:
        tasks += gluon_tasks(kernels, head_dims)
    # A build already in --out (this Triton's, same options) is not redone: a sweep
    # stopped halfway resumes where it was.
    rows = [r for r in read_rows(args.out) if r["triton"] == triton.__version__]
    done_keys = {build_key(r) for r in rows}
    tasks = [t for t in tasks if build_key(build_row(t)) not in done_keys]
    print(f"triton {triton.__version__}: {len(tasks)} builds ({len(rows)} already in "
          f"{args.out})", flush=True)
    with open(args.out, "a") as out, ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for done in as_completed([pool.submit(build, task) for task in tasks]):
            row = done.result()
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            if not row["built"]:
                print(f"FAIL {row['kernel']} d={row['head_dim']}: {row['error']}", flush=True)
    print("\n".join(summary(rows)))
    return 1 if not all(r["built"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
