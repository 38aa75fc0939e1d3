"""The one argument-validation module: types, ranges, windows, scales, choices, input files.

Every public entry point (the API, the reference, the models, the CLI) checks its
arguments with these functions, so a bad value always gets the same kind of
answer: a ``ValueError`` (wrong value) or ``TypeError`` (wrong kind) that names the
argument and what is allowed, quoting at most a short prefix of the value.

Scalars: a NumPy scalar or a 0-d tensor is accepted wherever a Python number is
(flash-attn takes ``np.float32(0.125)`` as ``softmax_scale``); ``bool`` is never an
int.  Pure Python: torch and NumPy are recognised duck-typed, never imported, so
the models can use this module without a tensor library.
"""

from __future__ import annotations

import math
import os
import reprlib
import stat
from collections.abc import Iterable
from typing import Any


class ArgumentTypeError(TypeError, ValueError):
    """A value of the wrong kind (a str for an int, a float for a window side).

    Both a TypeError (what Python and flash-attn raise for a wrong type) and a
    ValueError (what the models documented before this module existed), so a caller
    that catches either one catches it.
    """


# A value longer than this is quoted by its first characters only: an error message
# must stay one readable line whatever the input was (a 2 GB string included).
QUOTE_LIMIT = 60


def quote(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters with an ellipsis.

    Bounded work whatever the value: strings are cut before ``repr`` and containers
    are summarised a few levels deep (a YAML alias bomb's nested lists would
    otherwise take exponential time and memory to print).
    """
    if isinstance(value, (str, bytes)) and len(value) > 4 * limit:
        value = value[: 4 * limit]
    try:
        text = _SHORT_REPR.repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short_repr() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxlevel, short.maxdict, short.maxlist, short.maxtuple = 3, 4, 6, 6
    short.maxset = short.maxfrozenset = short.maxdeque = short.maxarray = 6
    short.maxstring, short.maxother, short.maxlong = 4 * QUOTE_LIMIT, 4 * QUOTE_LIMIT, 4 * QUOTE_LIMIT
    return short


_SHORT_REPR = _short_repr()


# Exact types that are never a tensor or array: answered first, so the checks trace
# under torch.compile(fullgraph=True) (dynamo folds these; it cannot trace str methods).
# Exact, not isinstance: np.float64 subclasses float and still goes through as_scalar.
_PLAIN_TYPES = (bool, int, float, complex, str, tuple, list, type(None))
# The modules that define torch.Tensor and NumPy's ndarray / scalar base classes.
_ARRAY_MODULES = ("torch", "numpy")


def _is_tensor_like(value: Any) -> bool:
    """A torch tensor or NumPy array/scalar (or a subclass), recognised without importing
    either: one of its classes is defined in ``torch`` or ``numpy`` and it has a dtype."""
    if type(value) in _PLAIN_TYPES:
        return False
    return hasattr(value, "dtype") and any(
        getattr(cls, "__module__", None) in _ARRAY_MODULES for cls in type(value).__mro__)


def _dtype_kind(value: Any) -> str | None:
    """'b' bool, 'i' integer, 'f' float, 'c' complex, or None: of a NumPy or torch scalar."""
    dtype = value.dtype
    kind = getattr(dtype, "kind", None)  # NumPy
    if kind in ("b", "i", "u", "f", "c"):
        return "i" if kind == "u" else kind
    if getattr(dtype, "is_complex", False):  # torch
        return "c"
    if getattr(dtype, "is_floating_point", False):
        return "f"
    name = str(dtype)
    if name == "torch.bool":
        return "b"
    if name.startswith(("torch.int", "torch.uint")):
        return "i"
    return None


def as_scalar(value: Any) -> Any:
    """A NumPy scalar, 0-d array or 0-d tensor as the Python number it holds; else unchanged."""
    if type(value) in _PLAIN_TYPES:
        return value
    if _is_tensor_like(value) and tuple(getattr(value, "shape", (None,))) == ():
        kind = _dtype_kind(value)
        if kind is None:
            return value
        item = value.item()
        return {"b": bool, "i": int, "f": float, "c": complex}[kind](item)
    return value


def _range_text(minimum, maximum, *, min_open: bool = False, max_open: bool = False) -> str:
    if minimum is not None and maximum is not None:
        return f" in {'(' if min_open else '['}{minimum:g}, {maximum:g}{')' if max_open else ']'}"
    if minimum is not None:
        return f" {'>' if min_open else '>='} {minimum:g}"
    if maximum is not None:
        return f" {'<' if max_open else '<='} {maximum:g}"
    return ""


def check_bool(name: str, value: Any) -> bool:
    """True or False (a NumPy or 0-d tensor bool too); TypeError otherwise (1 is not True)."""
    if type(value) is bool:  # the common case, without as_scalar's checks
        return value
    value = as_scalar(value)
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {quote(value)}")
    return value


def check_int(name: str, value: Any, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """An int (NumPy integer and 0-d integer tensor accepted; bool and float refused).

    TypeError for the wrong kind, ValueError outside ``[minimum, maximum]``.
    """
    # A plain int in range returns before the message text is built: public calls check
    # several ints per call (a decode step's host time is microseconds).
    if type(value) is int and (minimum is None or value >= minimum) and \
            (maximum is None or value <= maximum):
        return value
    value = as_scalar(value)
    allowed = _range_text(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int{allowed}, got {quote(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an int{allowed}, got {quote(value)}")
    return int(value)


def check_float(name: str, value: Any, *, minimum: float | None = None,
                maximum: float | None = None, min_open: bool = False, max_open: bool = False,
                finite: bool = True) -> float:
    """A real number as float (ints, NumPy and 0-d tensors accepted; bool, complex refused).

    NaN is always refused; infinities unless ``finite=False``.  ``min_open`` /
    ``max_open`` make a bound exclusive (``minimum=0, min_open=True``: > 0).
    """
    value = as_scalar(value)
    allowed = _range_text(minimum, maximum, min_open=min_open, max_open=max_open)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number{allowed}, got {quote(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{name} must be a finite number{allowed}, got {quote(value)}") from None
    if math.isnan(number) or (finite and math.isinf(number)):
        raise ValueError(f"{name} must be a finite number{allowed}, got {quote(value)}")
    too_low = minimum is not None and (number <= minimum if min_open else number < minimum)
    too_high = maximum is not None and (number >= maximum if max_open else number > maximum)
    if too_low or too_high:
        raise ValueError(f"{name} must be a finite number{allowed}, got {quote(value)}")
    return number


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``; ValueError listing them otherwise."""
    choices = tuple(choices)
    try:
        found = value in choices
    except TypeError:  # an unhashable value against a set-like: simply not a choice
        found = False
    if not found:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}; got {quote(value)}")
    return value


def check_window(value: Any, name: str = "window_size") -> tuple[int, int]:
    """flash-attn's ``(left, right)``: two ints >= -1, -1 meaning unbounded on that side."""
    if _is_tensor_like(value) and tuple(getattr(value, "shape", ())) == (2,):
        value = tuple(value.tolist())
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ArgumentTypeError(f"{name} must be a pair of ints (left, right), -1 = unbounded; "
                        f"got {quote(value)}")
    left, right = (as_scalar(side) for side in value)
    if any(isinstance(side, bool) or not isinstance(side, int) for side in (left, right)):
        raise ArgumentTypeError(f"{name} must be a pair of ints (left, right), -1 = unbounded; "
                        f"got {quote(value)}")
    if left < -1 or right < -1:
        raise ValueError(f"{name} entries must be >= -1 (-1 = unbounded), got {quote(value)}")
    return int(left), int(right)


def check_scale(value: Any, head_dim: int | None = None, name: str = "scale") -> float | None:
    """A positive finite softmax scale; None means ``1/sqrt(head_dim)`` (returned as such
    when ``head_dim`` is given, else None)."""
    if value is None:
        return None if head_dim is None else 1.0 / math.sqrt(head_dim)
    value = as_scalar(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a positive finite float or None, got {quote(value)}")
    number = _as_float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a positive finite float or None, got {quote(value)}")
    return number


def check_softcap(value: Any, name: str = "softcap") -> float:
    """flash-attn's softcap: a finite float >= 0, 0 meaning off."""
    value = as_scalar(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a finite float >= 0 (0 = off), got {quote(value)}")
    number = _as_float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{name} must be a finite float >= 0 (0 = off), got {quote(value)}")
    return number


def _as_float(value: int | float) -> float:
    """float(value); an int past float's range (2**2000) becomes inf, which the caller
    refuses as not finite, instead of an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


# What the fp32 Triton kernels can represent.  They work in base 2: every score is
# ``q.k * (scale * log2(e))`` (or, soft-capped, ``(softcap * log2(e)) * tanh(q.k *
# (scale / softcap))``) in fp32, and those factors travel as fp32 scalars.
FP32_MAX = 3.4028234663852886e38
FP32_MIN_NORMAL = 2.0**-126
FP16_MAX = 65504.0
_LOG2E = 1.4426950408889634
# The largest softcap / scale the kernels take (check_kernel_scales).
SOFTCAP_REACH = 2.0**100


def kernel_scale_range(head_dim: int) -> tuple[float, float]:
    """[lowest, highest] softmax scale the fp32 kernels compute exactly for ``head_dim``.

    Lowest: ``scale * log2(e)`` must be a normal fp32 -- a smaller factor is 0 (or a
    denormal the GPU flushes to 0), and a hidden key's -inf times 0 is NaN.  A tiny
    normal scale is fine math: every score underflows to 0 and attention is uniform.
    Highest: no score of inputs in fp16's range (``|x| <= 65504``, so ``|q.k| <=
    head_dim * 65504**2``) may overflow fp32 -- a +inf score makes inf - inf = NaN where
    the float64 math is finite.  (bf16 inputs past 65504 can overflow the fp32 dot
    product itself at any scale.)
    """
    lowest = FP32_MIN_NORMAL / _LOG2E
    highest = FP32_MAX / (_LOG2E * max(head_dim, 1) * FP16_MAX**2)
    return lowest, highest


def check_kernel_scales(scale: float, softcap: float, head_dim: int, *,
                        scale_name: str = "softmax_scale", softcap_name: str = "softcap") -> None:
    """ValueError with the allowed range when the fp32 kernels cannot represent ``scale``
    or ``softcap`` (already checked as positive finite / >= 0 numbers): see
    :func:`kernel_scale_range`.  With a softcap, ``softcap * log2(e)`` must be a finite
    fp32 and ``scale / softcap`` (which multiplies q.k inside the tanh) at most FP32_MAX
    (inf makes a zero q.k NaN) and at least 2**-100, so ``q.k * scale / softcap`` stays a
    normal fp32 for every ``|q.k| >= 2**-26`` (a GPU may flush a denormal to 0, which
    would zero the score); past that a cap changes no score an fp32 can hold anyway."""
    lowest, highest = kernel_scale_range(head_dim)
    if not lowest <= scale <= highest:
        raise ValueError(f"{scale_name} must be in [{lowest:.4g}, {highest:.4g}] for the fp32 "
                         f"Triton kernel at head_dim {head_dim} (scale * log2(e) a normal fp32; "
                         f"no score of fp16-range inputs past fp32), got {scale:g}")
    if softcap > 0:
        cap_lowest = scale / FP32_MAX
        cap_highest = min(FP32_MAX / _LOG2E, scale * SOFTCAP_REACH)
        if not cap_lowest <= softcap <= cap_highest:
            raise ValueError(f"{softcap_name} must be 0 (off) or in [{cap_lowest:.4g}, "
                             f"{cap_highest:.4g}] for the fp32 Triton kernel with "
                             f"{scale_name} {scale:g} (softcap * log2(e) a finite fp32, "
                             f"{scale_name} / softcap in [2**-100, fp32 max]), got {softcap:g}")


def check_strided(name: str, tensor: Any) -> Any:
    """``tensor`` if it is a dense (strided) tensor; TypeError naming it for a sparse or
    nested one, which no kernel or reference reads (torch's own error from deep inside
    the computation is no answer).  Duck-typed: torch is never imported here."""
    if getattr(tensor, "is_nested", False):
        raise ArgumentTypeError(f"{name} must be a dense (strided) tensor, got a nested tensor")
    layout = str(getattr(tensor, "layout", "torch.strided"))
    if layout != "torch.strided":
        raise ArgumentTypeError(f"{name} must be a dense (strided) tensor, got layout {layout}")
    return tensor


def check_index_tensor(name: str, tensor: Any, *, device: Any) -> Any:
    """An index tensor (``cu_seqlens_q/k``, ``cache_seqlens``, ``cache_batch_idx``,
    ``cache_leftpad``, ``block_table``) as the kernels read it: the one rule for all.

    Refused by name: not a tensor, sparse or nested (TypeError), a dtype other than
    torch.int32 (TypeError), another device than ``device`` or the meta device, whose
    values cannot be read (ValueError).  Accepted with any strides: the kernels read an
    index tensor with unit stride, so a view (a slice with a step, an expanded or
    transposed one) comes back as a contiguous copy -- one tiny copy, never a misread.
    """
    return _check_value_tensor(name, tensor, "torch.int32", device).contiguous()


def _check_value_tensor(name: str, tensor: Any, dtype: str, device: Any,
                        shapes: str = "") -> Any:
    """A dense tensor of ``dtype`` (torch's name) on ``device`` whose values a kernel
    reads: TypeError naming it for another kind or dtype, ValueError for another device
    or the meta device.  ``shapes`` joins the first message (what shapes are allowed)."""
    if not _is_tensor_like(tensor) or not hasattr(tensor, "contiguous"):
        raise ArgumentTypeError(f"{name} must be a {dtype} tensor{shapes}, got "
                                f"{type(tensor).__name__}")
    check_strided(name, tensor)
    if str(tensor.dtype) != dtype:
        raise ArgumentTypeError(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {tensor.device}")
    if tensor.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: attnlab reads its values, and a meta "
                         "tensor has none")
    return tensor


# ----- fp8 (e4m3) tensors and their descale factors ---------------------------------------
# torch's name of the one fp8 dtype attnlab reads (attnlab.dtypes.FP8_TORCH_NAME).
FP8_DTYPE = "torch.float8_e4m3fn"


def is_float8(tensor: Any) -> bool:
    """Whether ``tensor`` has any torch float8 dtype (e4m3fn, e4m3fnuz, e5m2, ...)."""
    return str(getattr(tensor, "dtype", "")).startswith("torch.float8")


def check_fp8_dtype(name: str, tensor: Any) -> bool:
    """True for a torch.float8_e4m3fn tensor, False for a non-float8 one; TypeError naming
    ``name`` and the one fp8 dtype attnlab reads for any other float8 (e5m2, the fnuz
    variants, e8m0)."""
    if not is_float8(tensor):
        return False
    if str(tensor.dtype) != FP8_DTYPE:
        raise ArgumentTypeError(
            f"{name}.dtype must be torch.float8_e4m3fn for fp8 (OCP e4m3: finite, range "
            f"+-448, what FA3 and vLLM's 'fp8' cache store), got {tensor.dtype}; e5m2 and the "
            "fnuz variants are not supported")
    return True


def check_descale(name: str, value: Any, *, batch: int, kv_heads: int, device: Any) -> Any:
    """An fp8 tensor's descale factor (FA3's and vLLM's: the real value is the fp8 value
    times the descale): a torch.float32 tensor on ``device`` of shape () or (1,) (one
    factor per tensor) or (batch, kv_heads) (per sequence and KV head).  Returns it as a
    (batch, kv_heads) view, stride 0 where it broadcasts: no copy and no host read, so a
    CUDA graph can capture the call.  Its values are not read here: a zero, negative or
    non-finite descale gives what the arithmetic gives (as in FA3)."""
    allowed = f"(), (1,) or (batch, kv_heads) = ({batch}, {kv_heads})"
    _check_value_tensor(name, value, "torch.float32", device, f" of shape {allowed}")
    shape = tuple(value.shape)
    if shape in ((), (1,)):
        return value.reshape(1, 1).expand(batch, kv_heads)
    if shape != (batch, kv_heads):
        raise ValueError(f"{name} must have shape {allowed}, got {shape}")
    return value


def _type_name(kind: type) -> str:
    """A type as a user writes it: attnlab's and Python's by name, another package's
    with the package in front (``torch.Tensor``)."""
    package = kind.__module__.split(".")[0]
    return kind.__name__ if package in ("builtins", "attnlab") else f"{package}.{kind.__name__}"


def check_instance(name: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    """``value`` if it is an instance of ``kind``; TypeError naming the expected type."""
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        expected = " or ".join(_type_name(k) for k in kinds)
        article = "an" if expected[0] in "AEIOU" else "a"
        raise ArgumentTypeError(f"{name} must be {article} {expected}, "
                                f"got {type(value).__name__}")
    return value


# What a path that is not a regular file is, for the refusal.
_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"))


def open_regular_file(path: str | os.PathLike, what: str = "file"):
    """``path`` opened for binary reading if it is a regular file; a ValueError naming
    ``what`` and the path otherwise (missing, unreadable, a folder, a FIFO, a device).

    Opened non-blocking first and checked with ``fstat`` on the open descriptor: reading
    a FIFO would wait forever for a writer, and a check before ``open`` could be raced.
    """
    text = os.fspath(path)
    try:
        descriptor = os.open(text, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                             | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path
        reason = getattr(error, "strerror", None) or str(error)
        raise ValueError(f"{what} {quote(text)} cannot be read: {reason}") from None
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            kind = next((label for test, label in _FILE_KINDS if test(mode)), "not a file")
            raise ValueError(f"{what} {quote(text)} is {kind}, not a regular file")
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_regular_file(path: str | os.PathLike, what: str = "file",
                      limit: int | None = None) -> bytes:
    """The bytes of a regular file (:func:`open_regular_file`'s refusals), at most
    ``limit`` of them when given: the caller sees ``limit`` bytes and can refuse more."""
    with open_regular_file(path, what) as handle:
        return handle.read() if limit is None else handle.read(limit)
