"""Launching a compiled Triton kernel without ``JITFunction.run``'s per-call work.

``kernel[grid](...)`` binds and specialises every argument on every call: 38-54 us of
host time for the Gluon forward's 22 arguments on the H200's host, against 12-16 us for
the compiled kernel's own launcher (bench/host_cost_h200.py, session 4 run 4).  At
N = 1k a training step is host-bound (bench/NOTES.md, B5), so the launchers keep each
compiled kernel under the key Triton itself specialises on and call its launcher
directly after the first call.  That uses Triton internals (what ``CompiledKernel.run``
hands its C function), which changed in 3.7: kernels/_compat.py probes which convention
this Triton's launcher has, and a Triton it does not recognise keeps ``kernel[grid](...)``.

Above the launches sit the launchers' plans (``PlanCache``, ``PlannedLaunch``): what a
call's sizes, strides, dtypes, alignment and options decide (tiles, kernel choice,
grids, the non-tensor arguments, the specialisation key) is worked out once per
signature, so a repeated call only allocates its outputs and launches.
"""

from __future__ import annotations

import functools

import torch
from triton import knobs
from triton.runtime import driver

from attnlab.kernels._compat import (
    direct_launch_refusal,
    launch_options,
    launcher_convention,
    tma_fill_name,
)
from attnlab.kernels._primitives import kernel_is_interpreted


def int_class(value: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an integer argument on: == 1, divisible by 16, 32-bit."""
    return value == 1, value % 16 == 0, -2**31 <= value < 2**31


class CompiledLaunch:
    """One compiled kernel launched through its C launcher.

    ``CompiledKernel.run`` spends per launch what is fixed per kernel: it builds launch
    metadata and calls the enter and exit hook chains even when they are empty, sizes
    scratch buffers the kernel does not use, and (for TMA descriptor arguments) walks the
    argument list in Python and re-encodes every descriptor.  On the H200's host that was
    75 us of the Gluon dK/dV launch with six descriptors (session 7 run 1, cProfile).
    ``__call__`` takes Triton's bound arguments and skips the empty hooks; ``raw`` takes
    the C launcher's final arguments (descriptors already encoded, ``TmaSlot``) and
    exists only where ``direct``: the kernel needs no scratch memory (nor GSan's extra
    arguments) and its launcher follows a convention ``_compat.launcher_convention``
    knows: Triton 3.6's launcher compiled per kernel takes the kernel's arguments one by
    one after the scratch buffers, metadata and hooks; 3.7's one variadic launcher takes
    metadata and hooks first, then the scratch buffers, the arguments' annotations and C
    signature, and the arguments as one sequence."""

    def __init__(self, compiled) -> None:
        run = compiled.run
        c_launch = run.launch
        if getattr(c_launch, "__name__", None) == "inner" and c_launch.__closure__:
            # wrap_handle_tensordesc's wrapper: the C launcher is its ``launcher`` cell.
            cells = zip(c_launch.__code__.co_freevars, c_launch.__closure__, strict=True)
            c_launch = {name: cell.cell_contents for name, cell in cells}.get("launcher")
        self.compiled, self.c_launch = compiled, c_launch
        self.tensordesc_meta = tuple(getattr(compiled.metadata, "tensordesc_meta", None) or ())
        convention = launcher_convention(type(run))
        self.direct = (c_launch is not None and convention is not None
                       and not (run.global_scratch_size or run.profile_scratch_size
                                or getattr(run, "gsan_enabled", False)))
        self.variadic = convention == "variadic"
        if self.variadic:
            self.fixed = (compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                          compiled.packed_metadata)
            self.after_hooks = (None, None, run.arg_annotations, run.kernel_signature)
            # The variadic launcher reads as many arguments as it has annotations without
            # counting what it was given: a launch must pass exactly that many (``takes``).
            self.arity = len(run.arg_annotations)
        else:
            self.fixed = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None,
                          None, compiled.packed_metadata)
            self.after_hooks, self.arity = (), None

    def takes(self, count: int) -> bool:
        """Whether the C launcher takes ``count`` final arguments (a per-kernel launcher
        checks its own count and raises)."""
        return self.arity is None or self.arity == count

    def goes_direct(self, count: int) -> bool:
        """Whether a launch with ``count`` bound arguments calls the C launcher itself (no
        TMA descriptor to encode, and as many arguments as the launcher takes)."""
        return self.direct and not self.tensordesc_meta and self.takes(count)

    def __call__(self, grid: tuple[int, ...], bound_args: tuple) -> None:
        """JITFunction.run after its cache lookup (the same call on Triton 3.6-3.9), with
        every parameter in signature order (the constexprs ride along; the launcher skips
        them)."""
        if self.goes_direct(len(bound_args)):
            self.raw(grid, bound_args)
            return
        stream = _current_stream()
        enter, exit_ = _hooks()
        metadata = self.compiled.launch_metadata(grid, stream, *bound_args) if enter else None
        grid = (*grid, 1, 1)
        self.compiled.run(grid[0], grid[1], grid[2], stream, self.compiled.function,
                          self.compiled.packed_metadata, metadata, enter, exit_, *bound_args)

    def raw(self, grid: tuple[int, ...], final_args) -> None:
        """The C launcher with its final arguments (``direct`` kernels only)."""
        self.direct_call(grid, len(final_args))(final_args)

    def direct_call(self, grid: tuple[int, ...], count: int):
        """``raw`` with ``grid`` fixed, for ``count`` final arguments: a function of them
        alone, which a plan launching one grid again and again keeps (``planned``), so a
        launch does not pad the grid or gather the launcher's fixed arguments again.  A
        launch with another count goes through ``__call__`` (the variadic launcher reads
        as many arguments as it has annotations, whatever it is given)."""
        c_launch, launch_metadata = self.c_launch, self.compiled.launch_metadata
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        if not self.variadic:
            fixed = self.fixed

            def launch(final_args) -> None:
                if len(final_args) != count:
                    self(grid, final_args)
                    return
                stream = _current_stream()
                enter, exit_ = _hooks()
                # Our kernels define no launch_metadata function, so Triton's metadata
                # does not read the arguments: the final ones serve as the bound ones.
                metadata = launch_metadata(grid, stream, *final_args) if enter else None
                c_launch(grid_x, grid_y, grid_z, stream, *fixed, metadata, enter, exit_,
                         *final_args)
            return launch
        # Triton 3.7+'s variadic launcher: its fixed arguments named one by one, so the
        # launch is a plain call (a star-call first builds a list: ~1.5k instructions per
        # launch, bench/NOTES.md S21).
        function, cooperative, pdl, packed_metadata = self.fixed
        global_scratch, profile_scratch, annotations, signature = self.after_hooks

        def launch_variadic(final_args) -> None:
            if len(final_args) != count:
                self(grid, final_args)
                return
            stream = _current_stream()
            enter, exit_ = _hooks()
            metadata = launch_metadata(grid, stream, *final_args) if enter else None
            c_launch(grid_x, grid_y, grid_z, stream, function, cooperative, pdl,
                     packed_metadata, metadata, enter, exit_, global_scratch, profile_scratch,
                     annotations, signature, final_args)
        return launch_variadic

    def planned(self, grid: tuple[int, ...], count: int):
        """``self(grid, final_args)`` as a function of ``final_args`` alone, for a plan
        whose launches pass ``count`` of them: the path ``__call__`` would pick on every
        launch is picked here once."""
        if self.goes_direct(count):
            return self.direct_call(grid, count)
        return functools.partial(self, grid)


def _current_stream() -> int:
    # Triton's own choice: the current device's current stream (torch.cuda.current_stream()
    # builds a Stream object, several microseconds per launch on the H200's host).
    active = driver.active
    return active.get_current_stream(active.get_current_device())


def _hooks() -> tuple:
    """The launch hook chains, or (None, None) while no hook is registered (a profiler
    such as proton registers them): the C launcher then calls neither."""
    runtime = knobs.runtime
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    try:  # read per launch: a HookChain's calls directly (getattr with a default costs more)
        if enter.calls or exit_.calls:
            return enter, exit_
    except AttributeError:  # a hook that is no HookChain: always passed on
        return enter, exit_
    return None, None


class TmaSlot:
    """One TMA descriptor argument of a planned launch, as the C launcher takes it: the
    encoded CUtensorMap (``make_tensordesc_arg``'s work for a tiled descriptor, from the
    compiled kernel's descriptor metadata) and then the shape and strides.  Only the base
    pointer changes per call; the last encoding is kept and reused while the pointer
    repeats (the caching allocator hands a training loop the same addresses step after
    step).  ``supported`` says which descriptors it encodes as Triton would."""

    __slots__ = ("fill", "encoding", "tail", "last")

    @staticmethod
    def supported(fields: dict, meta: dict) -> bool:
        """A tiled descriptor (not fp4-padded, not rounded to tf32) and an encoder to call."""
        return not (meta.get("fp4_padded") or meta.get("is_im2col")
                    or fields.get("round_f32_to_tf32")
                    or tma_fill_name(driver.active.utils) is None)

    def __init__(self, shape, strides, padding: str, meta: dict) -> None:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

        # The same arguments under both names (3.7 renamed fill_tma_descriptor).
        utils = driver.active.utils
        self.fill = getattr(utils, tma_fill_name(utils))
        self.encoding = (meta["swizzle"], meta["elem_size"],
                         TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
                         list(shape), list(strides), 1 if padding == "nan" else 0)
        self.tail = (*shape, *strides)
        self.last = (None, None)  # (pointer, its encoding)

    def __call__(self, t: torch.Tensor):
        pointer = t.data_ptr()
        # One read and one write of ``last``: threads launching through the same plan
        # each get the encoding of their own pointer.
        last = self.last
        if last[0] != pointer:
            last = (pointer, self.fill(pointer, *self.encoding))
            self.last = last
        return last[1]


def _arg_class(value) -> object:
    """The part of an argument Triton's specialisation sees."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int_class(value)
    if isinstance(value, float):
        return float
    raise TypeError(f"no launch class for a {type(value).__name__} argument")


def launch_cached(cache: dict, key: tuple, kernel, grid: tuple[int, ...], args: tuple,
                  meta: dict, **options) -> None:
    """``kernel[grid](*args, **meta, **options)`` the first time per ``key`` (what Triton
    specialises on), the compiled kernel's own launcher after that (``CompiledLaunch``,
    kept in ``cache``).  ``args`` are the runtime parameters in signature order; ``meta``
    names every constexpr parameter (plus launch options such as a Triton kernel's
    num_warps); ``options`` go to the first launch only (a Gluon kernel's maxnreg)."""
    constexprs = kernel.arg_names[len(args):]
    launch = cache.get(key)
    if launch is None:
        if not set(constexprs) <= meta.keys() or set(kernel.arg_names[:len(args)]) & meta.keys():
            raise RuntimeError("attnlab bug: a launch must pass the runtime parameters of "
                               f"{kernel.fn.__name__} by position and every constexpr one "
                               "by name")
        cache[key] = CompiledLaunch(kernel[grid](*args, **meta, **options, **launch_options()))
        return
    launch(grid, (*args, *(meta[name] for name in constexprs)))


class TracedLauncher:
    """A ``wrap_triton(kernel)`` behind DirectLauncher's interface, for traced calls.

    The launchers name each kernel in ``wrap_triton(<kernel>)`` themselves: torch finds a
    triton_op's kernels by reading its source for exactly that call (AOTAutograd's cache
    key hashes their sources), so the wrapping cannot move into a helper."""

    def __init__(self, wrapped) -> None:
        self.wrapped = wrapped

    def key(self, args: tuple, meta: dict) -> None:
        return None

    def launch(self, key, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
        self.wrapped[grid](*args, **meta)

    def compiled_launch(self, key, arg_count: int, meta: dict) -> tuple[None, None]:
        return None, None


class DirectLauncher:
    """``launch(key, grid, args, meta)`` runs ``kernel[grid](*args, **meta)`` the first
    time per specialisation ``key`` (``self.key(args, meta)``) and the compiled kernel
    directly after that (``launch_cached``).  ``args`` are the runtime parameters in
    signature order, ``meta`` every constexpr parameter plus launch options (num_warps,
    num_stages, ...).  For real calls only: a traced one launches through
    ``wrap_triton`` (TracedLauncher)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}

    def key(self, args: tuple, meta: dict) -> tuple | None:
        """What Triton specialises this launch on, or None where every launch goes
        through ``kernel[grid]`` (Triton's CPU interpreter has no compiled kernel to keep)."""
        if direct_launch_refusal() is not None or kernel_is_interpreted():
            return None
        return (tuple(_arg_class(a) for a in args), tuple(meta.items()),
                args[0].device if isinstance(args[0], torch.Tensor) else None)

    def launch(self, key: tuple | None, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
        """The launch with ``key`` (``self.key`` of arguments of the same classes)."""
        if key is None:
            self.kernel[grid](*args, **meta, **launch_options())
        else:
            launch_cached(self.compiled, key, self.kernel, grid, args, meta)

    def compiled_launch(self, key: tuple | None, arg_count: int, meta: dict):
        """(the compiled launch kept under ``key``, the constexpr values that follow the
        ``arg_count`` runtime arguments), or (None, None) before the first launch or
        where every launch goes through ``kernel[grid]``."""
        launch = None if key is None else self.compiled.get(key)
        if launch is None:
            return None, None
        return launch, tuple(meta[name] for name in self.kernel.arg_names[arg_count:])


class PlannedLaunch:
    """One launch of a cached plan (``PlanCache``): the grid, the arguments after the
    leading tensors and the constexprs are fixed by the call's signature, so each call
    passes only its tensors, and the specialisation key is computed once."""

    __slots__ = ("launcher", "grid", "static", "meta", "key", "keyed", "run", "tail")

    def __init__(self, launcher, grid: tuple[int, ...], static: tuple, meta: dict) -> None:
        self.launcher, self.grid, self.static, self.meta = launcher, grid, static, meta
        self.key, self.keyed = None, False
        # After the first launch: the compiled launch as a function of the final arguments
        # (``CompiledLaunch.planned``) and everything after the tensors (the static
        # arguments, then the constexprs), so a call skips launch_cached's lookup and
        # argument assembly (microseconds per launch on the H200's host).
        self.run, self.tail = None, None

    def launch(self, *tensors) -> None:
        """Launch with these leading tensors (``plan.launch(...)`` is ``plan(...)``
        without the ~1k instructions CPython spends finding ``__call__``)."""
        run = self.run
        if run is not None:
            run(tensors + self.tail)  # one tuple concatenation (a star-display builds a list)
            return
        args = (*tensors, *self.static)
        if not self.keyed:
            self.key, self.keyed = self.launcher.key(args, self.meta), True
        self.launcher.launch(self.key, self.grid, args, self.meta)
        compiled, constexprs = self.launcher.compiled_launch(self.key, len(args), self.meta)
        if compiled is not None:
            self.tail = (*self.static, *constexprs)
            self.run = compiled.planned(self.grid, len(tensors) + len(self.tail))

    __call__ = launch


class PlanCache:
    """A launcher's plans by call signature: what the tensors' sizes, strides, dtypes and
    alignment plus the call's options decide (tiles, kernel choice, grids, arguments),
    worked out once per signature rather than on every call.  Keeps the ``size`` most
    recently added (a run over many shapes does not grow it without bound)."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self.plans: dict[tuple, object] = {}
        # The last plan ``find`` found, with its key (one tuple: a thread reads a pair).
        self.last: tuple = (None, None)

    def find(self, key: tuple):
        """The plan kept under ``key``, or None.  The last key found is compared first:
        a decode loop repeats one signature, and one comparison of the key costs about
        half a dict lookup, which hashes it too (bench/NOTES.md S21)."""
        last = self.last
        if key == last[0]:
            return last[1]
        plan = self.plans.get(key)
        if plan is not None:
            self.last = (key, plan)
        return plan

    def get(self, key: tuple, build):
        plan = self.plans.get(key)
        if plan is None:
            plan = build()
            if len(self.plans) >= self.size:
                del self.plans[next(iter(self.plans))]
            self.plans[key] = plan
        return plan


def tensor_key(*tensors) -> tuple:
    """Per tensor: dtype, shape, strides and whether its data is 16-byte aligned (None
    for an absent one) — with the device and options, what a plan depends on."""
    return tuple(None if t is None else (t.dtype, t.shape, t.stride(), t.data_ptr() % 16 == 0)
                 for t in tensors)
