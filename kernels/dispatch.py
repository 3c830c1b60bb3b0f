"""Which implementation a kernel wrapper runs: the Triton kernel or the pure-torch reference.

Default ("auto"): Triton for CUDA tensors, the torch reference elsewhere. Every wrapper takes `backend=` to
override it (an engine's is `LLM(kernel_backend=...)` / `--kernel-backend`, which reaches the models' kernels
through their caches). Forcing "triton" on CPU tensors works under `TRITON_INTERPRET=1` (slow, exact): that is
how the kernel tests run without a GPU.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "torch")


def triton_available() -> bool:
    # find_spec, not import: importing triton fixes TRITON_INTERPRET for the process (see lazy_jit)
    return importlib.util.find_spec("triton") is not None


def triton_compiles_for_nvidia() -> bool:
    """Whether triton's NVIDIA backend is installed: kernels can be compiled for a GPU (sm_90) without one."""
    if not triton_available():
        return False
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


class KernelBackendError(ValueError, RuntimeError):
    """A kernel backend that cannot run here; a ValueError, so the CLI reports it as one line (exit 2)."""


def choose_backend(tensor: torch.Tensor, backend: str | None = None) -> str:
    """Resolve `backend` (None: "auto") to "triton" or "torch"."""
    choice = backend or "auto"
    source = f"kernel backend {choice!r}"
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend {choice!r} is not one of {BACKENDS}")
    if choice == "auto":
        return "triton" if tensor.is_cuda and triton_available() else "torch"
    if choice == "triton":
        if not triton_available():
            raise KernelBackendError(f"{source}: triton is not installed; pip install triton, or use the torch "
                                     f"kernels (kernel_backend / --kernel-backend torch or auto)")
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise KernelBackendError(f"{source}: the Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 to run "
                                     f"on the CPU (slowly); or use the torch kernels (kernel_backend / --kernel-backend "
                                     f"torch or auto)")
    return choice


def check(condition: bool, message: str) -> None:
    """Argument validation for wrappers: a ValueError that names the argument."""
    if not condition:
        raise ValueError(message)


class LazyJit:
    """A Triton kernel whose `@triton.jit` decoration waits for its first launch (`kernel[grid](...)`).

    Importing a kernel module therefore never imports triton: CPU-only installs and the torch path do not
    need it, and `TRITON_INTERPRET` (which triton reads when it is imported and when a function is
    decorated) only has to be set before the first launch, not before the first `import specdec`.
    Materialising one kernel decorates every `LazyJit` of its module in place (kernels call their helpers
    by global name) and binds the module's global `tl` to `triton.language`; it happens once.
    """

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def materialize(self):
        import triton
        import triton.language

        module_globals = self.fn.__globals__
        module_globals["tl"] = triton.language
        for name, obj in list(module_globals.items()):
            if isinstance(obj, LazyJit):
                module_globals[name] = triton.jit(obj.fn)
        return module_globals[self.fn.__name__]

    def __getitem__(self, grid):
        return self.materialize()[grid]


def lazy_jit(fn) -> LazyJit:
    """Decorator: `@triton.jit`, applied at the first launch (see `LazyJit`)."""
    return LazyJit(fn)


def interpreting() -> bool:
    """True under the Triton interpreter (`TRITON_INTERPRET=1`): kernels run on the CPU through numpy."""
    return os.environ.get("TRITON_INTERPRET") == "1"


INTERPRETER_PROGRAMS = 3  # "streaming multiprocessors" of the interpreter: persistent kernels loop over tiles
_PROGRAMS: dict = {}  # device index -> multiprocessor count (read once per device; explicit, see device_programs)


def device_programs(device) -> int:
    """How many programs a persistent kernel launches at most on `device`: its multiprocessor count on CUDA,
    INTERPRETER_PROGRAMS elsewhere (the interpreter), so that the tile loop runs more than once in tests.
    Only the grid depends on it, never a tile or a summation order."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROGRAMS:
        _PROGRAMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _PROGRAMS[index]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@contextlib.contextmanager
def num_threads(n: int):
    """torch runs `n` intra-op threads inside the block (the caller's count is restored after it)."""
    threads = torch.get_num_threads()
    if n == threads:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread():
    """torch runs one intra-op thread inside the block (the caller's count is restored after it)."""
    return num_threads(1)
