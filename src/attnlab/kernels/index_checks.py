"""Where the kernels report a bad index: one small record per device, read when asked.

``flash_attn_with_kvcache`` and the paged ``flash_attn_varlen_func`` never read an index
tensor on the host (a device-to-host copy is a synchronisation: 0.4-1.4 ms of host time
per call on the H200, issue #32, and no copy can run under CUDA-graph capture).  The
kernels check every value where they read it (``_primitives._sequence_bounds``,
``_checked_pages``, the append kernel) and a bad one is

* never used as an address: the sequence reads as empty (or its page as page 0) and
  its new keys are not written;
* visible in the result: that sequence's output rows and LSE are NaN (a contested
  cache slot, where two appends meet, holds NaN);
* recorded here: per kind, the first bad sequence (the smallest index wins), where,
  the value and the bound it broke, kept until :func:`check_index_errors` reads them.

:func:`check_index_errors` synchronises, raises the ValueError naming the argument, and
clears the record; call it where the caller synchronises anyway (a server: after reading
the sampled tokens).  The record is one int64 tensor per device, made by the first call
on that device and then reused, so a CUDA graph captured later keeps writing into it.
"""

from __future__ import annotations

import threading

import torch

# kind -> (argument, what the bound means); the kernels write kind k at slots 3k..3k+2.
KINDS = (
    ("cache_seqlens", "must be in [0, capacity - seqlen_new] = [0, {limit}]"),
    ("cache_leftpad", "must be in [0, cache_seqlens[{seq}]] = [0, {limit}]"),
    ("cache_batch_idx", "must be a cache row in [0, {limit})"),
    ("block_table", "must be a page index in [0, num_pages = {limit})"),
    ("block_table / cache_batch_idx", "append into one cache slot (position {column} of "
                                      "sequence {seq}): the slot now holds NaN; give each "
                                      "sequence its own {own}"),
    ("rotary position", "must be in [0, seqlen_ro = {limit}) (the rows of rotary_cos/"
                        "rotary_sin; positions start at rotary_seqlens[b] when given, else "
                        "at cache_seqlens[b])"),
    ("seqused_k", "(keys of the sequence) must be in [0, {limit}] (the keys sequence {seq} "
                  "has: its cu_seqlens_k length, or block_table.shape[1] x page size)"),
)
SEQLENS, LEFTPAD, BATCH_IDX, BLOCK_TABLE, SHARED_SLOT, ROTARY, KEYS_USED = range(len(KINDS))
_NONE = 2**63 - 1  # "no error": every record is smaller
_buffers: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def error_buffer(device: torch.device) -> torch.Tensor:
    """The device's error record, made on first use.  Made under CUDA-graph capture it
    would be refilled by every replay, erasing what it holds, so a first use there is
    refused: the eager warm-up call that capture needs anyway (it compiles the
    kernels) makes it."""
    buffer = _buffers.get(device)
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attnlab's index-error record for this device does not exist "
                               "yet: make one eager call before capturing a CUDA graph (it "
                               "also compiles the kernels)")
        with _lock:
            buffer = _buffers.setdefault(
                device, torch.full((3 * len(KINDS),), _NONE, dtype=torch.int64, device=device))
    return buffer


def _split(packed: int) -> tuple[int, int]:
    """(sequence, the signed 32-bit field) of one ``sequence << 32 | field`` entry."""
    low = packed & 0xFFFFFFFF
    return packed >> 32, low - (1 << 32) if low >= 1 << 31 else low


def index_errors(device=None, *, clear: bool = True) -> list[str]:
    """What the kernels recorded on ``device`` (default: the current CUDA device, else
    the CPU) since the last read, one sentence per kind; synchronises with the device.
    ``clear`` resets the record."""
    device = torch.device(device if device is not None else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = _buffers.get(device)
    if buffer is None:
        return []
    values = buffer.tolist()
    if clear and any(v != _NONE for v in values):
        buffer.fill_(_NONE)
    found = []
    for kind, (name, bound) in enumerate(KINDS):
        column, value, limit = values[3 * kind:3 * kind + 3]
        if column == _NONE:
            continue
        seq, column = _split(column)
        value, limit = _split(value)[1], _split(limit)[1]
        # The shared-slot record's limit names the form: 1 a block table, 0 cache rows.
        form, own = (("block_table", "pages") if limit else ("cache_batch_idx", "cache row"))
        where = {BLOCK_TABLE: f"{name}[{seq}, {column}] = {value}",
                 SHARED_SLOT: (f"{form} makes sequences {seq} and {value}" if value != seq
                               else f"{form} makes sequence {seq} (a repeated page) twice"),
                 ROTARY: f"{name} of sequence {seq} (new key or query) = {value}",
                 }.get(kind, f"{name}[{seq}] = {value}")
        found.append(f"{where} {bound.format(seq=seq, column=column, value=value, limit=limit, own=own)}")
    return found


def check_index_errors(device=None) -> None:
    """Raise ValueError for every bad index a kernel recorded on ``device`` since the last
    check (clearing the record); nothing if none.  Synchronises with the device."""
    found = index_errors(device)
    if found:
        raise ValueError("an attnlab call read bad index tensors (those sequences' outputs "
                         "are NaN and their new keys were not written): " + "; ".join(found))
