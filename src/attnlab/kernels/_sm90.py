"""What the Gluon sm_90 kernels share: the Gluon calls whose spelling differs between
Triton releases (``tma_load_box``), host-side TMA descriptors, the alignment TMA needs,
the device facts they are sized by, and the compile-only evidence (SASS from
``_aot.disassemble``).

Imported only where ``_compat.gluon_refusal()`` is None: the spellings come from its
probes of the installed Gluon (kernels/_compat.py), never from a version string.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from attnlab.inputs import layout_named
from attnlab.kernels._aot import disassemble
from attnlab.kernels._compat import gluon_api, gluon_refusal, launch_options, log
from attnlab.kernels._launch import CompiledLaunch, TmaSlot, launch_cached

if gluon_refusal() is not None:
    raise ImportError(f"attnlab's Gluon kernels cannot be built here: {gluon_refusal()}")

# The global -> shared TMA copy under this Triton's name (async_load from 3.8), and the
# barrier of a partition's threads (``barrier`` from 3.7).
tma_load = getattr(tma, gluon_api().tma_load)
partition_barrier = getattr(gl, gluon_api().barrier)

# A ring of per-row statistics (LSE, D) that TMA fills, [STAGES, 1, rows] fp32.  Its
# layout is NVMMA's for the placement alone: TMA writes only to 128-byte aligned shared
# memory, and the allocator places a swizzled-layout buffer at 16 bytes (session 17: two
# more warp_specialize captures moved the backward's LSE ring to 196880, "misaligned
# address").  Unswizzled, its slots are plain rows (``row_slot``).
ROW_RING_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                    rank=2))
PLAIN_ROW = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[0]))

# The box a TMA descriptor copies is (1, 1, rows, head dim) (or (1, 1, rows)); the tiles
# the MMAs read are the same bytes without the leading 1s, so each copy lands in its tile
# reinterpreted as the descriptor's box: ``reinterpret`` from 3.9, ``_reinterpret`` before.
if gluon_api().reinterpret == "reinterpret":
    @gluon.jit
    def tma_load_box(desc, coord, barrier, tile):
        """TMA copy of ``desc``'s box at ``coord`` into ``tile``, completing ``barrier``."""
        tma_load(desc, coord, barrier, tile.reinterpret(desc.dtype, desc.block_shape,
                                                        desc.layout))

    @gluon.jit
    def row_slot(ring, stage):
        """Slot ``stage`` of a ``ROW_RING_LAYOUT`` ring as the plain row it holds."""
        return ring.index(stage).reinterpret(ring.dtype, [ring.shape[2]], PLAIN_ROW)

    @gluon.jit
    def reinterpreted(tile, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """The same shared-memory bytes as a tile of ``dtype``, ``shape``, ``layout``."""
        return tile.reinterpret(dtype, shape, layout)
else:
    @gluon.jit
    def tma_load_box(desc, coord, barrier, tile):
        """TMA copy of ``desc``'s box at ``coord`` into ``tile``, completing ``barrier``."""
        tma_load(desc, coord, barrier, tile._reinterpret(desc.dtype, desc.block_shape,
                                                         desc.layout))

    @gluon.jit
    def row_slot(ring, stage):
        """Slot ``stage`` of a ``ROW_RING_LAYOUT`` ring as the plain row it holds."""
        return ring.index(stage)._reinterpret(ring.dtype, [ring.shape[2]], PLAIN_ROW)

    @gluon.jit
    def reinterpreted(tile, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """The same shared-memory bytes as a tile of ``dtype``, ``shape``, ``layout``."""
        return tile._reinterpret(dtype, shape, layout)


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
             torch.float8_e4m3fn: gl.float8e4nv}
# Hopper's register file: 64K 32-bit registers per SM; the kernels run one CTA per SM.
REGISTER_FILE = 65536
SHARED_MEMORY_LIMIT = 232448  # bytes per block on sm_90 (227 KB)


def hardware_refusal(capability: tuple[int, int] | None, dtype: torch.dtype,
                     dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> str | None:
    """Why a Gluon sm_90 kernel cannot run on this GPU / dtype (one of ``dtypes``), or
    None."""
    if capability is None:
        return "needs CUDA tensors on an sm_90 (Hopper) GPU"
    if capability != (9, 0):
        return f"built for sm_90 only; this GPU is sm_{capability[0]}{capability[1]}"
    if dtype not in dtypes:
        return f"dtype must be one of {', '.join(map(str, dtypes))}, got {dtype}"
    return None


def backward_refusal(kernel: str, supported_head_dims: tuple[int, ...], *,
                     capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int,
                     window: tuple[int, int], softcap: float, layout: str,
                     aligned: bool) -> str | None:
    """Why a Gluon backward kernel (``kernel``: "dK/dV", "dQ") must not compute a call,
    short of its config's shared memory (the kernel's own ``refusal`` asks that), or
    None."""
    reason = hardware_refusal(capability, dtype)
    if reason is not None:
        return reason
    if layout_named(layout).is_varlen:
        return f"layout must be 'bshd' or 'bhsd' (varlen stays on the Triton kernel), got {layout!r}"
    if head_dim not in supported_head_dims:
        return f"head_dim must be one of {supported_head_dims}, got {head_dim}"
    if tuple(window) != (-1, -1):
        return f"sliding windows are not implemented in the sm_90 {kernel} kernel"
    if softcap != 0.0:
        return f"softcap is not implemented in the sm_90 {kernel} kernel"
    if not aligned:
        return ("TMA needs a unit-stride head dim, 16-byte aligned base pointers and nonzero "
                "strides, and non-empty sequences")
    return None


def sized_backward_refusal(kernel: str, supported_head_dims: tuple[int, ...],
                           default_configs: dict, shared_memory_bytes, config,
                           **call) -> str | None:
    """A Gluon backward kernel's ``refusal``: ``backward_refusal``'s reasons for the
    call's facts (``call``: capability, dtype, head_dim, window, softcap, layout,
    aligned), then whether ``config`` (default: the head dim's) fits in shared memory
    (``shared_memory_bytes(head_dim, config)``)."""
    reason = backward_refusal(kernel, supported_head_dims, **call)
    if reason is not None:
        return reason
    head_dim = call["head_dim"]
    config = config or default_configs[head_dim]
    return shared_memory_refusal(config, shared_memory_bytes(head_dim, config), head_dim)


def backward_supports(refusal, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      dout: torch.Tensor, *, layout: str, window: tuple[int, int],
                      softcap: float, config) -> tuple[bool, str]:
    """(True, "") if the kernel whose ``refusal`` this is computes the call, else (False,
    the reason).  ``dout`` must already be what the kernel reads (the caller copies an
    expanded dO first)."""
    capability = on_sm90_capability(q) if all(t.is_cuda for t in (k, v, dout)) else None
    if len({q.dtype, k.dtype, v.dtype, dout.dtype}) != 1:
        return False, "q, k, v and dout must share one dtype"
    reason = refusal(capability=capability, dtype=q.dtype, head_dim=q.shape[-1],
                     window=window, softcap=softcap, layout=layout,
                     aligned=tma_aligned(q, k, v, dout), config=config)
    return reason is None, reason or ""


def check_producer_regs(producer_regs: int) -> None:
    """setmaxnreg takes multiples of 8; below 24 the producer warp cannot hold its loop."""
    if producer_regs % 8 or not 24 <= producer_regs <= 64:
        raise ValueError(f"producer_regs must be a multiple of 8 in [24, 64], "
                         f"got {producer_regs}")


def shared_memory_refusal(config, needed: int, head_dim: int) -> str | None:
    """Why ``config`` cannot run for lack of shared memory, or None."""
    if needed > SHARED_MEMORY_LIMIT:
        return (f"{config} needs {needed} bytes of shared memory at head_dim {head_dim}; "
                f"sm_90 has {SHARED_MEMORY_LIMIT}")
    return None


def tma_aligned(*tensors: torch.Tensor) -> bool:
    """4-D, non-empty, unit-stride last dim, 16-byte aligned base and strides, no zero
    stride (an expanded tensor is not a TMA operand)."""
    for t in tensors:
        if t.dim() != 4 or t.numel() == 0 or t.stride(-1) != 1:
            return False
        if t.data_ptr() % 16 or any(s == 0 or (s * t.element_size()) % 16
                                    for s in t.stride()[:-1]):
            return False
    return True


def on_sm90_capability(t: torch.Tensor) -> tuple[int, int] | None:
    return capability(t.device) if t.is_cuda and torch.cuda.is_available() else None


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def descriptor(t: torch.Tensor, layout: str, rows: int) -> TensorDescriptor:
    """A host TMA descriptor over t as (batch, head, sequence, head dim), whatever its
    memory layout, with a box of ``rows`` rows of one (batch, head): TMA zero-fills rows
    past the sequence's end and never reads the next one."""
    return TensorDescriptor(t, *descriptor_parts(t, layout, rows))


def descriptor_parts(t: torch.Tensor, layout: str, rows: int) -> tuple:
    """``descriptor``'s arguments after the tensor: what a planned launch keeps, building
    only the descriptor itself per call (its base is the call's tensor)."""
    lay = layout_named(layout)
    sb, sh, ss = lay.bhs_strides(t)
    batch, seqlen, heads, head_dim = t.shape[0], lay.seqlen(t), lay.heads(t), t.shape[-1]
    return ([batch, heads, seqlen, head_dim], [sb, sh, ss, 1], [1, 1, rows, head_dim],
            box_layout((1, 1, rows, head_dim), t.dtype))


def row_stat_descriptor_parts(t: torch.Tensor, length: int, rows: int) -> tuple:
    """``descriptor_parts`` for a per-row statistic (LSE, D) held as a contiguous
    (batch, head, padded sequence) fp32 tensor: the first ``length`` entries of each
    (batch, head) row, with a box of ``rows`` of them; TMA zero-fills the box past
    ``length``, so the padding is never read.  TMA needs 16-byte strides and a box row of
    a multiple of 16 bytes: a padded length and ``rows`` that are multiples of 4."""
    return ([*t.shape[:2], length], list(t.stride()), [1, 1, rows],
            box_layout((1, 1, rows), t.dtype))


class PlannedDescriptor:
    """A TensorDescriptor checked once, when a launch is planned, and re-based per call
    on a tensor of the same dtype, shape, strides and 16-byte alignment (what the plan's
    key fixes): TensorDescriptor's own checks cost several microseconds per descriptor
    on the H200's host, six of them per backward.  ``example`` may be a meta tensor of
    the right shape for buffers the call allocates itself."""

    def __init__(self, example: torch.Tensor, parts: tuple) -> None:
        self.fields = dict(TensorDescriptor(example, *parts).__dict__)
        # A plan outlives its first call: holding that call's tensor would keep its memory.
        del self.fields["base"]

    def __call__(self, t: torch.Tensor) -> TensorDescriptor:
        rebased = object.__new__(TensorDescriptor)
        rebased.__dict__.update(self.fields)
        rebased.base = t
        return rebased


class PlannedGluonLaunch:
    """A Gluon kernel's launch for one call signature: ``(bases, tensors)`` re-bases the
    planned descriptors on ``bases`` and launches with ``tensors`` and the arguments the
    plan fixed after them, under the plan's specialisation ``key`` (``launch_cached``).
    Once the kernel is compiled (and where ``CompiledLaunch.direct``), later calls encode
    the descriptors themselves (``TmaSlot``) and call the C launcher with the final
    arguments."""

    def __init__(self, cache: dict, kernel, grid: tuple[int, ...], descriptors: tuple,
                 static: tuple, constexprs: dict, key: tuple, maxnreg: int) -> None:
        self.cache, self.kernel, self.grid, self.descriptors = cache, kernel, grid, descriptors
        self.static, self.constexprs, self.key, self.maxnreg = static, constexprs, key, maxnreg
        self.launch = self.run = self.slots = self.tail = None

    def __call__(self, bases: tuple, tensors: tuple) -> None:
        if self.launch is None and not self._go_direct(len(tensors)):
            args = (*(planned(t) for planned, t in zip(self.descriptors, bases, strict=True)),
                    *tensors, *self.static)
            launch_cached(self.cache, self.key, self.kernel, self.grid, args, self.constexprs,
                          maxnreg=self.maxnreg)
            return
        args = []
        for slot, t in zip(self.slots, bases, strict=True):
            args.append(slot(t))
            args.extend(slot.tail)
        self.run((*args, *tensors, *self.tail))

    def _go_direct(self, num_tensors: int) -> bool:
        """Switch to the direct path once the kernel is compiled under this key."""
        launch = self.cache.get(self.key)
        if not (isinstance(launch, CompiledLaunch) and launch.direct
                and len(launch.tensordesc_meta) == len(self.descriptors)
                and all(TmaSlot.supported(d.fields, meta) for d, meta
                        in zip(self.descriptors, launch.tensordesc_meta, strict=True))):
            return False
        slots = tuple(TmaSlot(d.fields["shape"], d.fields["strides"], d.fields["padding"], meta)
                      for d, meta in zip(self.descriptors, launch.tensordesc_meta, strict=True))
        runtime = len(self.descriptors) + num_tensors + len(self.static)
        tail = (*self.static,
                *(self.constexprs[name] for name in self.kernel.arg_names[runtime:]))
        count = sum(1 + len(slot.tail) for slot in slots) + num_tensors + len(tail)
        if not launch.takes(count):
            return False
        self.slots, self.tail, self.launch = slots, tail, launch
        # The C launch with the grid fixed, as PlannedLaunch keeps it (``direct_call``).
        self.run = launch.direct_call(self.grid, count)
        return True


@functools.cache
def box_layout(box: tuple[int, ...], dtype: torch.dtype):
    # Built once per box: each call is several microseconds of host time per launch.
    return gl.NVMMASharedLayout.get_default_for(list(box), GL_DTYPES[dtype])


def launch_maxnreg(consumer_warps: int) -> int:
    """The kernel-wide register cap at launch: the consumer warps plus the producer's
    warpgroup (warps are allocated by fours) share the register file at one CTA per SM;
    setmaxnreg then moves registers from the producer to the consumers (240 at 24)."""
    return REGISTER_FILE // ((consumer_warps + 4) * 32) // 8 * 8


def compile_sm90(kernel, signature: dict, constants: dict, aligned: tuple[str, ...],
                 maxnreg: int):
    """``kernel`` compiled for sm_90a without a GPU (``.asm['ptx']``, ``.asm['cubin']``,
    ``.metadata``).  ``aligned`` names the arguments a launch on contiguous tensors
    specialises as 16-divisible (without it, stores compile to narrower ones)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource(kernel, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": constants["num_warps"], "maxnreg": maxnreg,
                                   **launch_options()})


def code_evidence(asm: dict) -> tuple[dict, str | None]:
    """What compiled code shows, and its SASS (None without cuobjdump): setmaxnreg per
    role, ``wait_group 1`` count (a wgmma left in flight), the partition barriers'
    thread counts (128 = one warpgroup; 256 would tie two consumers together), the
    register cap, and from the SASS the HGMMA count, spills and highest register."""
    ptx = asm["ptx"]
    evidence = {
        "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)",
                                            ptx))),
        "wait_group_1": ptx.count("wgmma.wait_group.sync.aligned 1"),
        "barrier_threads": sorted({int(n) for n in re.findall(r"bar\.sync\s+\d+,\s*(\d+)", ptx)}),
        "maxnreg": int(m.group(1)) if (m := re.search(r"\.maxnreg (\d+)", ptx)) else None,
    }
    sass = disassemble(asm["cubin"])
    if sass is not None:
        evidence.update(
            hgmma=len(re.findall(r"\bHGMMA\.", sass)),
            local_memory_ops=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
            highest_register=max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=0),
        )
    return evidence, sass


def entry_bucket(entry: dict) -> tuple:
    """A dispatch-table entry's bucket: (head_dim, causal, length bucket)."""
    return entry["head_dim"], entry["causal"], entry["bucket"]


def select_entries(table: dict, running: str) -> tuple[list[dict], str | None]:
    """(the entries to dispatch by, a note or None) of a dispatch table on Triton
    ``running``.  Each entry names the Triton it was measured on (``triton``, else the
    table's ``source``) and a bucket that wins on one release may not on another (the
    d = 256 forward's vector store spills on 3.9 and not on 3.6), so per bucket the entry
    measured on ``running`` decides where the table has one; elsewhere the entry of the
    table's own release stands in (the kernels compile the same schedule on 3.6-3.9) and
    the note says how many buckets do.  An entry whose ``config`` is None records that
    the Triton kernel measured faster there: it dispatches nothing."""
    reference = table["source"]["triton"]
    chosen, own = {}, set()
    for entry in table["entries"]:
        release = entry.get("triton", reference)
        if release == running:
            chosen[entry_bucket(entry)] = entry
            own.add(entry_bucket(entry))
        elif release == reference and entry_bucket(entry) not in own:
            chosen[entry_bucket(entry)] = entry
    stand_ins = len(chosen) - len(own)
    note = None if running == reference or not stand_ins else (
        f"{stand_ins} bucket(s) have no entry measured on Triton {running}; those measured "
        f"on {reference} stand in")
    return [e for _, e in sorted(chosen.items()) if e["config"] is not None], note


def merged_table(current: dict | None, entries: list[dict], measured: set, env: dict) -> dict:
    """A dispatch table after a run on Triton ``env["triton"]`` that timed the buckets
    ``measured`` and found the Gluon kernel faster in ``entries`` (each with its
    ``config``): this release's entries for those buckets are replaced, a measured bucket
    without a winner gets a ``config: None`` entry (the Triton kernel runs it), and every
    other entry -- other buckets, other releases -- is kept as it was.  The table's
    ``source`` (the release entries without a ``triton`` of their own were measured on,
    and that stands in for a release's unmeasured buckets) stays the current table's."""
    release, current = env["triton"], current or {}
    run = {key: env.get(key) for key in ("gpu", "git_commit", "timestamp")}
    won = {entry_bucket(e): {**e, "triton": release, "measured": run} for e in entries}
    new = [won.get(bucket) or dict(zip(("head_dim", "causal", "bucket"), bucket, strict=True),
                                       config=None, triton=release, measured=run)
           for bucket in measured]
    source = current.get("source") or {
        key: env.get(key) for key in ("gpu", "torch", "triton", "driver", "cuda_runtime",
                                      "cudnn", "git_commit", "timestamp", "command")}

    def release_of(entry):
        return entry.get("triton", source["triton"])

    kept = [e for e in current.get("entries", [])
            if not (release_of(e) == release and entry_bucket(e) in measured)]
    return {**current, "source": source,
            "entries": sorted(kept + new, key=lambda e: (entry_bucket(e), release_of(e)))}


@functools.cache
def dispatch_entries(filename: str) -> list[dict]:
    """The entries of the committed dispatch table ``filename`` (in ``attnlab/kernels``)
    for the installed Triton (``select_entries``); a stand-in is logged once."""
    text = importlib.resources.files("attnlab.kernels").joinpath(filename).read_text()
    entries, note = select_entries(json.loads(text), triton.__version__)
    if note is not None:
        log.info("attnlab: %s: %s", filename, note)
    return entries
