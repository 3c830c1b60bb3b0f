"""Which torch device to run on: `"auto"` (CUDA when a GPU is present, else the CPU) or an explicit one,
checked up front so that a device that does not exist is one clear error saying what is available."""
from __future__ import annotations

import os

import torch

AUTO = "auto"


def available_devices() -> list[str]:
    """The devices this machine can run on, e.g. `["cpu", "cuda:0", "cuda:1"]`."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    return devices


def resolve_device(spec="auto", name: str = "device") -> torch.device:
    """`spec` (a string or torch.device) -> a torch.device that exists here; `name` is the argument or flag
    named in errors. "auto" is CUDA when available, else the CPU. Raises ValueError for anything else."""
    if isinstance(spec, str) and spec.strip().lower() == AUTO:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    available = available_devices()
    if not isinstance(spec, (str, torch.device)):
        raise ValueError(f"{name} must be a device name such as 'cpu' or 'cuda' (or 'auto'), got {spec!r}; "
                         f"available here: {', '.join(available)}")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"{name} {spec!r} is not a device name (e.g. 'auto', 'cpu', 'cuda', 'cuda:1'); "
                         f"available here: {', '.join(available)}") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = "without CUDA support" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
            raise ValueError(f"{name} {spec!r}: no CUDA GPU is available (torch {torch.__version__} is built "
                             f"{built}); available here: {', '.join(available)}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {spec!r}: there are only {torch.cuda.device_count()} CUDA device(s); "
                             f"available here: {', '.join(available)}")
        return device
    if device.type == "mps" and "mps" in available:
        return device
    raise ValueError(f"{name} {spec!r}: not available or not supported; available here: {', '.join(available)}")


def engine_device(spec, target) -> torch.device:
    """The device of an `LLM`: `spec` resolved as above, except that "auto" with a model *object* (not a
    checkpoint path) means where that model already lives: its `device` attribute, else the CPU."""
    if isinstance(spec, str) and spec.strip().lower() == AUTO and not isinstance(target, (str, os.PathLike)):
        spec = getattr(target, "device", None) or "cpu"
    return resolve_device(spec)
