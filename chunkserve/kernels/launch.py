"""Triton kernels launched from their compiled form, past the dispatcher.

Every call of ``kernel[grid](...)`` runs Triton's dispatcher (``JITFunction.run``): it binds the
arguments, specializes each one (its dtype; 16-byte alignment of a pointer; an int equal to 1,
divisible by 16, or past 32 bits), turns that into a cache key and looks the compiled kernel up.
That host work more than doubles a launch's cost, the more so the more arguments a kernel takes,
and a decode step makes ~100 such launches between its graph pieces (chunkserve/replicas/engine/piecewise.py;
figures: chunkserve/kernels/tools/records/README.md, 'Figures behind the code').

``launch`` takes from the caller a key that tells apart exactly what the dispatcher would: the
constexprs and launch options, and what specializes each runtime argument (the caller knows
which of its arguments can vary: see ``launch``). The first call of a key goes through the
dispatcher, which compiles or finds the kernel and launches it; later calls of the key launch the
compiled kernel directly. Under ``TRITON_INTERPRET=1`` there is nothing compiled: every call goes
through the interpreter as before.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

__all__ = ["aligned", "first_launched", "first_launches", "launch", "verifying"]

_compiled: dict[tuple, CompiledKernel] = {}
_verify = False
_first_s = 0.0  # host seconds of the keys' first launches (the dispatcher's, with any compile)


def aligned(*pointers) -> tuple[bool, ...]:
    """The dispatcher's pointer specialization: 16-byte alignment of each tensor (None: None)."""
    return tuple(None if p is None else p.data_ptr() % 16 == 0 for p in pointers)


def launch(fn, grid: tuple[int, int, int], args: tuple, options: dict, key: tuple) -> None:
    """``fn[grid](*args, **options)``, with the dispatcher's work done once per key.

    args: every parameter of fn in order, constexprs included (the compiled launcher takes them
    all and skips the constexprs). key: hashable, the same for two calls only where the
    dispatcher would pick the same compiled kernel: their constexprs, options and argument
    dtypes, ``aligned`` of every pointer that can vary in alignment, the value of every int
    argument it specializes (or declare the int ``do_not_specialize``). A key of fewer parts
    would launch a kernel compiled for other arguments: ``verifying`` checks keys against the
    dispatcher.
    """
    global _first_s
    if not isinstance(fn, JITFunction):  # the interpreter's: nothing compiled
        fn[grid](*args, **options)
        return
    full = (fn, driver.active.get_current_device(), key)
    kernel = _compiled.get(full)
    if kernel is None:
        t0 = time.perf_counter()
        kernel = fn[grid](*args, **options)
        _first_s += time.perf_counter() - t0
        _compiled[full] = kernel
        return
    if _verify:
        found = fn.run(*args, grid=grid, warmup=True, **options)
        if found is not kernel:
            raise AssertionError(f"{fn.__name__}: key {key} launched a kernel compiled for other arguments")
    stream = driver.active.get_current_stream(full[1])
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    metadata = kernel.launch_metadata(grid, stream, *args) if enter is not None else None
    kernel.run(
        grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *args
    )


def first_launched(since: int = 0) -> list[str]:
    """The kernels of the keys launched so far, in order, from the `since`-th (a first_launches
    count): which variants a run compiled, by kernel name."""
    return [fn.__name__ for fn, _, _ in list(_compiled)[since:]]


def first_launches() -> tuple[int, float]:
    """(keys launched so far, host seconds their first launches took): each first launch went
    through the dispatcher and may have compiled, so a count that grows after warmup means
    compiles on a user's request (chunkserve.replicas.tools.bench reports it per run)."""
    return len(_compiled), _first_s


@contextlib.contextmanager
def verifying() -> Iterator[None]:
    """Within: every direct launch first asks the dispatcher which kernel it would run and fails
    if that is not the one launched (tests: each key tells apart what the dispatcher does)."""
    global _verify
    before, _verify = _verify, True
    try:
        yield
    finally:
        _verify = before
