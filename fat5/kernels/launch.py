"""Launching the fused kernels with a fraction of ``kernel[grid](...)``'s host time.

Every ``kernel[grid](*args)`` call makes Triton bind and specialise all arguments, build a string cache key, read
its settings from the environment and query the current device and stream: about 25 µs for a 9-argument kernel and
several times that for the 48- to 65-argument attention kernels, measured on an H100 host, where an eager T5 step
launches some 350 of them and is bound by the host's time at batch 16. ``CachedLauncher`` keeps the compiled kernel
that Triton returns under a key of its own and then calls the compiled kernel's launcher directly.

Two keys lead to a compiled kernel. The specialisation key is Triton's own: the value of every constexpr and launch
option, and for every other argument what Triton specialises on: a tensor's dtype and whether its address is 16-byte
aligned, an integer's width, whether it is 1 and whether it is a multiple of 16 (only the width for the integers the
kernel does not specialise on). Two calls with the same specialisation key get the same compiled kernel from Triton,
so reusing it is exact. The fast key, looked up first, holds the integers' values instead (one C-level tuple, no
Python loop over them); a miss maps the call to its specialisation, so a new length does not launch the slow way.
Under ``TRITON_INTERPRET=1`` (CPU tests) the plain launch runs. Triton's launch hooks
(``knobs.runtime.launch_enter_hook``, used by Proton) are not called on the cached path; set
``FAT5_PLAIN_TRITON_LAUNCH=1`` before importing fat5 (or call ``set_plain_launch(True)``) to launch every kernel the
plain way.

The launcher keys on the current CUDA device and launches on its current stream: launch under ``device_guard``.
"""

import contextlib
import functools
import operator
import os

import torch

_MAX_FAST_KEYS = 4096
_INT32 = range(-(2**31), 2**31)
_INT64 = range(-(2**63), 2**63)


def device_guard(device: torch.device):
    """Make ``device`` the current CUDA device for the launches inside (nothing on the CPU interpreter)."""
    # The index, not the torch.device: torch.cuda.device then skips parsing it (the guard's enter and exit take 1.2
    # instead of 2.4 µs on an H100 host, and an eager base-shape step makes some 350 launches).
    return torch.cuda.device(device.index) if device.type == "cuda" else contextlib.nullcontext()


# Host-side arithmetic of the launchers. Triton's own ``triton.cdiv`` and ``triton.next_power_of_2`` are
# ``ConstexprFunction`` objects since Triton 3.5: about 2 µs a call from Python, against tens of nanoseconds here, and
# an eager training step computes some thousand grids and block sizes.
def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def next_power_of_2(value: int) -> int:
    return 1 << (value - 1).bit_length() if value > 0 else 0


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(device: torch.device, interpreter_count: int) -> int:
    """The GPU's multiprocessor count (cached per device), or ``interpreter_count`` on the CPU interpreter."""
    if device.type != "cuda":
        return interpreter_count
    return _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


def _plain_launch_only() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("FAT5_PLAIN_TRITON_LAUNCH") == "1"


# Read once: two environment lookups in every launch cost about a millisecond of an eager training step's host time.
_plain_launch = _plain_launch_only()


def set_plain_launch(plain: bool) -> None:
    """Launch every kernel through Triton's own ``kernel[grid](...)`` (True), or through the cache (False, the
    default outside the interpreter; the interpreter always launches the plain way)."""
    global _plain_launch
    _plain_launch = bool(plain) or os.environ.get("TRITON_INTERPRET") == "1"


def _integer_width(value: int):
    return 32 if value in _INT32 else 64 if value in _INT64 else "u64"


def _integer_specialisation(value: int):
    """What Triton compiles an integer argument for: its width, and whether it is 1 (a constant) or divisible by 16."""
    return _integer_width(value), value == 1, value % 16 == 0


def _getter(indices):
    """``args -> tuple of args[i] for i in indices`` (itemgetter returns a bare item for a single index)."""
    if len(indices) == 1:
        index = indices[0]
        return lambda args: (args[index],)
    if not indices:
        return lambda args: ()
    return operator.itemgetter(*indices)


class _ArgumentLayout:
    """Where the tensors and integers sit among a kernel's runtime arguments, for one sequence of argument types."""

    def __init__(self, types, unspecialized_names, names):
        integers = [i for i, kind in enumerate(types) if kind is int]
        self.tensors = _getter([i for i, kind in enumerate(types) if issubclass(kind, torch.Tensor)])
        # integers Triton specialises (== 1, multiple of 16) count by value in the fast key, by class in the
        # specialisation key; the others (do_not_specialize) by width in both
        self.specialized = _getter([i for i in integers if names[i] not in unspecialized_names])
        self.unspecialized = _getter([i for i in integers if names[i] in unspecialized_names])
        for kind in types:
            if not (kind is int or kind is float or kind is bool or issubclass(kind, torch.Tensor)):
                raise TypeError(f"CachedLauncher cannot key an argument of type {kind.__name__}")

    def key(self, args):
        """The fast key: specialised integers by value."""
        return (*self._tensor_key(args), self.specialized(args), tuple(map(_integer_width, self.unspecialized(args))))

    def specialisation(self, args):
        """Triton's specialisation of the arguments."""
        return (
            *self._tensor_key(args), tuple(map(_integer_specialisation, self.specialized(args))),
            tuple(map(_integer_width, self.unspecialized(args))),
        )

    def _tensor_key(self, args):
        tensors = self.tensors(args)
        addresses = 0
        for tensor in tensors:
            addresses |= tensor.data_ptr()
        alignment = True if addresses % 16 == 0 else tuple(tensor.data_ptr() % 16 == 0 for tensor in tensors)
        return tuple([tensor.dtype for tensor in tensors]), alignment


class CachedLauncher:
    """``launcher[grid](*args, **kwargs)`` launches ``kernel`` as ``kernel[grid](*args, **kwargs)`` does; the
    kernel's constexpr parameters must come after all the others (as in all of FAT5's kernels)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}  # fast key -> compiled kernel
        self.specialisations = {}  # specialisation key -> compiled kernel
        self.layouts = {}
        self.runtime_names = None  # read from the JITFunction at the first compiled-path launch

    def _read_signature(self):
        params = self.kernel.params
        name = self.kernel.fn.__name__
        runtime_names = [p.name for p in params if not p.is_constexpr]
        self.constexpr_names = [p.name for p in params if p.is_constexpr]
        if [p.name for p in params] != runtime_names + self.constexpr_names:
            raise TypeError(f"{name}: CachedLauncher needs the constexpr parameters last")
        unspecialized = getattr(self.kernel, "do_not_specialize", ())
        self.unspecialized_names = {params[i].name if isinstance(i, int) else i for i in unspecialized}
        self.runtime_names = runtime_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        if _plain_launch:
            return self.kernel[grid](*args, **kwargs)
        if self.runtime_names is None:
            self._read_signature()
        if len(args) < len(self.runtime_names):  # runtime arguments given by name
            kwargs = dict(kwargs)
            missing = self.runtime_names[len(args):]
            if not set(missing) <= set(kwargs):
                raise TypeError(f"{self.kernel.fn.__name__}: runtime arguments {sorted(set(missing) - set(kwargs))} "
                                "not given")
            args = (*args, *[kwargs.pop(name) for name in missing])
        types = tuple(map(type, args))
        layout = self.layouts.get(types)
        if layout is None:
            if len(args) != len(self.runtime_names):
                raise TypeError(f"{self.kernel.fn.__name__} takes {len(self.runtime_names)} runtime arguments, "
                                f"got {len(args)}")
            layout = self.layouts[types] = _ArgumentLayout(types, self.unspecialized_names, self.runtime_names)
        device = torch.cuda.current_device()
        options = (device, tuple(kwargs.items()), types)
        key = (*options, *layout.key(args))
        compiled = self.compiled.get(key)
        if compiled is None:
            specialisation = (*options, *layout.specialisation(args))
            compiled = self.specialisations.get(specialisation)
            if compiled is None:
                # Triton compiles (or finds) the kernel and launches it; later calls reuse what it returned
                self.compiled[key] = self.specialisations[specialisation] = self.kernel[grid](*args, **kwargs)
                return
            if len(self.compiled) >= _MAX_FAST_KEYS:  # lengths that change every call (decoding) must not pile up
                self.compiled.clear()
            self.compiled[key] = compiled
        grid = (*grid, 1, 1)
        compiled.run(
            grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
            compiled.packed_metadata, None, None, None, *args, *[kwargs[name] for name in self.constexpr_names],
        )
