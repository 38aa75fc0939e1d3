"""GPU ceilings for rooflines: datasheet peaks, or ceilings you measured yourself.

Datasheet figures are dense (no 2:4 sparsity) FP16/BF16 Tensor Core peaks and HBM
bandwidth, SXM parts.  They are ceilings nobody reaches: the peer H200 run measured
701.5 TFLOP/s for an 8192^3 bf16 GEMM and 4.27 TB/s for a 2 GiB copy against the
datasheet's 989 and 4.8 (../shared/anchors/h200-peers.jsonl), so pass measured
ceilings (``measured_ceilings`` / ``ceilings_from_records``) when you have them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

from attnlab.checks import check_float, check_int, quote


@dataclass(frozen=True)
class GPU:
    """Two ceilings of one GPU; units in the names (TFLOP/s = 1e12 FLOP/s, TB/s = 1e12 B/s)."""

    name: str
    dense_tflops: float  # dense FP16/BF16 Tensor Core FLOP/s, in TFLOP/s
    hbm_tbps: float      # HBM bandwidth, in TB/s
    source: str          # "datasheet" or "measured" (with what, where)
    sm_count: int | None = None   # streaming multiprocessors (the cache model's waves)
    l2_bytes: int | None = None   # L2 cache, bytes (what torch reports as L2_cache_size)
    # The capacity of the one LRU cache model/l2.py replays row reads through: fitted to
    # measurements, not a datasheet fact (GH100_L2_LRU_FIT_BYTES says on what).
    l2_lru_fit_bytes: int | None = None

    def __post_init__(self) -> None:
        for field_name in ("dense_tflops", "hbm_tbps"):
            check_float(field_name, getattr(self, field_name), minimum=0, min_open=True)
        for field_name in ("sm_count", "l2_bytes", "l2_lru_fit_bytes"):
            if getattr(self, field_name) is not None:
                check_int(field_name, getattr(self, field_name), minimum=1)

    @property
    def ridge_point(self) -> float:
        """FLOP/byte where the two roofs meet: peak FLOP/s over peak bytes/s."""
        return self.dense_tflops / self.hbm_tbps

    def attainable_tflops(self, flop_per_byte: float) -> float:
        """Roofline ceiling at an arithmetic intensity: min(compute roof, intensity x bandwidth)."""
        intensity = _check_intensity(flop_per_byte)
        return min(self.dense_tflops, intensity * self.hbm_tbps)

    def bound(self, flop_per_byte: float) -> str:
        """'memory' below the ridge point, 'compute' at or above it."""
        return "memory" if _check_intensity(flop_per_byte) < self.ridge_point else "compute"

    def min_time_s(self, flops: int, bytes_moved: int) -> float:
        """Roofline lower bound on a kernel's time: the slower of its two roofs."""
        return max(flops / (self.dense_tflops * 1e12), bytes_moved / (self.hbm_tbps * 1e12))

    def as_dict(self) -> dict:
        # The cache facts belong to the cache model's table rows, not the roofline's.
        ceilings = {k: v for k, v in asdict(self).items()
                    if k not in ("sm_count", "l2_bytes", "l2_lru_fit_bytes")}
        return {**ceilings, "ridge_point": self.ridge_point}


def _check_intensity(flop_per_byte: float) -> float:
    return check_float("flop_per_byte", flop_per_byte, minimum=0)


# FITTED, NOT A FACT of the hardware: the capacity at which one LRU cache, replaying the
# Gluon dK/dV launches' Q/dO/LSE/D tile reads in the block scheduler's order (model/l2.py,
# cache.predict_gluon_dkdv), gives the DRAM bytes Nsight Compute measured.  Fitted on an
# H100 SXM, the seed's layer (24q/4kv, d = 256, causal, 4k, bf16), bench/NOTES.md B23: it
# put both launches' Q/dO reads within 10% of session 16 run 2's and session 17 run 3's
# (two program orders; run 3's counters are bench/results/runs/2026-12-07-s17-run3/
# ncu-new/ncu_backward/ncu_kernels.csv).  With K, V, the row statistics and the writes,
# run 3's dV and dK launches come out +6.4% and -1.5% (tests/test_model_l2.py); 34-42 MB
# keeps both within 15%, 30 or 45 do not.  Less than the 50 MiB on the chip: rows every
# SM reads are held in both L2 partitions (cache.py, assumption 4), and L2 is not one LRU
# cache.  The H200 (the same GH100 L2) takes it unmeasured.
GH100_L2_LRU_FIT_BYTES = 37 * 10**6

# NVIDIA product pages / datasheets, dense FP16/BF16 (the sparse figure is twice these).
# SMs and L2 (the cache model's facts): H100 and H200 share the GH100 die as sold, 132
# SMs and 50 MiB of L2 (what torch.cuda.get_device_properties reports on both); A100
# SXM: 108 SMs, 40 MiB.  B200's are left out until measured here.
GPUS: dict[str, GPU] = {
    "A100": GPU("A100", 312.0, 2.039, "datasheet: A100 SXM 80GB, 312 TFLOP/s dense FP16, 2.039 TB/s HBM2e",
                sm_count=108, l2_bytes=40 * 2**20),
    "H100 SXM": GPU("H100 SXM", 989.0, 3.35, "datasheet: H100 SXM, 989 TFLOP/s dense FP16, 3.35 TB/s HBM3",
                    sm_count=132, l2_bytes=50 * 2**20,
                    l2_lru_fit_bytes=GH100_L2_LRU_FIT_BYTES),
    "H200": GPU("H200", 989.0, 4.8, "datasheet: H200 SXM, 989 TFLOP/s dense FP16, 4.8 TB/s HBM3e",
                sm_count=132, l2_bytes=50 * 2**20, l2_lru_fit_bytes=GH100_L2_LRU_FIT_BYTES),
    "B200": GPU("B200", 2250.0, 8.0, "datasheet: HGX B200 (1000 W), 2.25 PFLOP/s dense FP16, 8 TB/s HBM3e"),
}

# Spellings people type; the key is the normalised form (lower case, no spaces/-/_).
_ALIASES = {"a100": "A100", "a100sxm": "A100", "h100": "H100 SXM", "h100sxm": "H100 SXM",
            "h200": "H200", "h200sxm": "H200", "b200": "B200"}


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def gpu(name: str) -> GPU:
    """The datasheet entry of a named GPU ('H100', 'h100-sxm' and 'H100 SXM' all work)."""
    if not isinstance(name, str):
        raise TypeError(f"gpu name must be a string, one of {sorted(GPUS)}; got {quote(name)}")
    key = _ALIASES.get(_normalise(name))
    if key is None:
        raise ValueError(f"unknown GPU {quote(name)}; known: {', '.join(sorted(GPUS))}")
    return GPUS[key]


def ridge_point(name_or_gpu: str | GPU) -> float:
    """FLOP/byte at the ridge (H100 SXM: 989 / 3.35 = 295.2; A100: 153.0)."""
    return (name_or_gpu if isinstance(name_or_gpu, GPU) else gpu(name_or_gpu)).ridge_point


def measured_ceilings(name: str, *, dense_tflops: float | None = None,
                      hbm_tbps: float | None = None, how: str = "measured") -> GPU:
    """A named GPU with one or both ceilings replaced by measured values."""
    base = gpu(name)
    if dense_tflops is None and hbm_tbps is None:
        raise ValueError("give dense_tflops and/or hbm_tbps: a measured ceiling needs a value")
    return replace(
        base,
        dense_tflops=base.dense_tflops if dense_tflops is None else dense_tflops,
        hbm_tbps=base.hbm_tbps if hbm_tbps is None else hbm_tbps,
        source=f"{how}: dense_tflops "
               f"{'from the datasheet' if dense_tflops is None else f'{dense_tflops:.4g}'}, "
               f"hbm_tbps {'from the datasheet' if hbm_tbps is None else f'{hbm_tbps:.4g}'}",
    )


def ceilings_from_records(name: str, records: Iterable[dict]) -> GPU:
    """Measured ceilings from peak records (``{"kind": "peak", "tflops": ...}`` and
    ``{"kind": "peak", "tbps": ...}``, the format of the peer anchors file)."""
    tflops = tbps = None
    for record in records:
        if not isinstance(record, dict) or record.get("kind") != "peak":
            continue
        if "tflops" in record:
            tflops = float(record["tflops"])
        if "tbps" in record:
            tbps = float(record["tbps"])
    if tflops is None and tbps is None:
        raise ValueError("records hold no peak record with 'tflops' or 'tbps' "
                         "(expected lines like {\"kind\": \"peak\", \"tflops\": 701.5})")
    return measured_ceilings(name, dense_tflops=tflops, hbm_tbps=tbps, how="measured peak records")
