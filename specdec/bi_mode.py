"""`LLM(batch_invariant=...)`: whether the models run batch-invariant numerics (models/numerics.py), and the
"auto" setting (the default of `LLM` and of `--batch-invariant`) that turns the mode on where it is cheap.

What each setting promises (docs/api.md, docs/design.md "Batch-invariant numerics"):
- `True`: the mode on for the target and the draft. A token's logits are the same bits whatever else shares
  its forward, so every method's greedy output equals AR's (AR with the mode on) bit for bit in every dtype,
  and a seeded sampled request gives the same tokens at any batch size. Costs speed.
- `False`: the models as they are (model objects untouched; a quantized checkpoint loads with its mode on,
  models/quant.py "Exactness"). Greedy speculative output equals AR's only up to near-ties in float32 and
  bfloat16 (bitwise in float64).
- `"auto"`: `True` where it is cheap, else `False`. On CUDA, for a speculative method, a short measurement at
  start-up times a target forward with the mode on and off at the run's batch size and at one and k + 1 new
  tokens per row (k_max + 1 with auto k), AUTO_REPEATS each, interleaved; the mode is on when its worst ratio
  is at most AUTO_MAX_COST (1.15). The forwards are timed, and the times cached for checkpoints given as
  paths, by the start-up measurement (specdec/startup.py: its one warm-up per model and way it runs, its one
  cache file `cost_cache`, default ~/.cache/specdec/costs.json, and its summary line). Everywhere else "auto" is
  `False`: on the CPU (float models off, quantized ones on, as today), for "ar" (its own reference), with
  `compile=True` (the mode runs the eager forward), for model objects without the mode, and where the
  target is already in the mode (a quantized model).
"""
from __future__ import annotations

import sys
from typing import Callable, NamedTuple

import torch

from specdec.startup import StartupMeasurement, cache_key, model_identity

AUTO = "auto"
SETTINGS = (True, False, AUTO)
AUTO_MAX_COST = 1.15  # "auto" turns the mode on when a target forward costs at most this many times as much
AUTO_REPEATS = 3  # timed forwards per (mode, shape), after a warm-up; the median counts
AUTO_ROUNDS = 2  # off/on interleaved this many times; the fastest round of each counts (noise only slows)
AUTO_CONTEXT = 128  # tokens already in the cache for the measured forwards


class Choice(NamedTuple):
    """What `choose` decided: the mode `on` or not, why, and the measured cost (mode on / off) if measured."""

    on: bool
    setting: object  # what was asked: True, False or "auto"
    reason: str
    cost: float | None = None  # worst (time on / time off) over the measured shapes


def pays(on_s: float, off_s: float, limit: float = AUTO_MAX_COST) -> bool:
    """Whether a forward taking `on_s` seconds with the mode and `off_s` without costs at most `limit` times as much."""
    return on_s <= limit * off_s


def worst_cost(times: dict) -> float:
    """times {T: (on_s, off_s)} -> the largest on/off ratio."""
    return max(on / off for on, off in times.values())


def measure_cost(model, rows: int, lengths, measurement: StartupMeasurement, context: int = AUTO_CONTEXT,
                 repeats: int = AUTO_REPEATS, rounds: int = AUTO_ROUNDS) -> dict:
    """{T: (seconds with the mode, seconds without)}: one forward of T new tokens per row on `rows` rows on top
    of `context` cached tokens, the mode off and on interleaved `rounds` times (the fastest of each counts),
    timed by `measurement`. The model's mode is restored afterwards."""
    was = model.batch_invariant
    limit = getattr(getattr(model, "cfg", None), "max_position_embeddings", None)
    if limit:  # a short-context model: the prefix and the new tokens must fit its positions
        context = max(1, min(context, limit - max(lengths) - 2))
    best: dict = {}
    try:
        for _ in range(rounds):
            for T in lengths:
                for mode in (False, True):
                    model.batch_invariant = mode
                    seconds, _ = measurement.time_forward(model, rows, T, context, repeats, "all")
                    key = (T, mode)
                    best[key] = min(seconds, best.get(key, float("inf")))
    finally:
        model.batch_invariant = was
    return {T: (best[T, True], best[T, False]) for T in lengths}


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def triton_version() -> str:
    """Triton's version ("none" without it: the mode's CUDA kernels are Triton's, so their cost is its)."""
    try:
        import importlib.metadata

        return importlib.metadata.version("triton")
    except Exception:  # noqa: BLE001 (no triton, or no metadata: the key just says so)
        return "none"


def choose(setting, target, draft, device, speculative: bool, batch_size: int, k, k_max: int, compile: bool,
           target_spec=None, measurement: StartupMeasurement | None = None, measure: Callable | None = None) -> Choice:
    """Resolve `setting` (True, False, "auto") for a run; see the module docstring. `measurement`: the start-up
    measurement that times and caches (None: one of this call's own, on the default cache file).
    `measure(model, rows, lengths, measurement)` -> {T: (on_s, off_s)} (default `measure_cost`; injectable:
    tests)."""
    if setting is not AUTO:  # True or False (the option's rule checked it: specdec/options.py)
        return Choice(setting, setting, "asked")
    models = [m for m in (target, draft) if m is not None]
    if not speculative:
        return Choice(False, setting, "ar: AR is its own reference")
    if not is_cuda(device):
        return Choice(False, setting, f"{torch.device(device).type}: on CUDA only")
    if compile:
        return Choice(False, setting, "compile=True: the mode runs the eager forward")
    if not all(hasattr(m, "batch_invariant") for m in models):
        return Choice(False, setting, "a model object without the mode")
    if target.batch_invariant:
        return Choice(False, setting, "the target is in the mode already (a quantized model)")
    lengths = sorted({1, (k if isinstance(k, int) else k_max) + 1})
    shape = f"B={batch_size}, T={'/'.join(map(str, lengths))}"
    measurement = measurement if measurement is not None else StartupMeasurement()
    target_id = model_identity(target, target_spec)
    key = cache_key("batch-invariant", [target_id], getattr(target, "dtype", None), device,
                    f"triton={triton_version()}", f"B={batch_size}", f"T={','.join(map(str, lengths))}",
                    f"ctx={AUTO_CONTEXT}") if target_id else None
    times, cached = measurement.measure(
        key, lambda: (measure or measure_cost)(target, batch_size, lengths, measurement),
        decode=lambda entry: {int(T): (float(on), float(off)) for T, (on, off) in entry.items()},
        describe=lambda times: f"batch-invariant cost {worst_cost(times):.2f}x ({shape})",
        check=lambda times: set(times) == set(lengths))
    cost = worst_cost(times)
    on = cost <= AUTO_MAX_COST
    reason = (f"{'cached' if cached else 'measured'}: a target forward at {shape} costs {cost:.2f}x "
              f"with the mode (limit {AUTO_MAX_COST}x)")
    return Choice(on, setting, reason, cost)


def announce(choice: Choice) -> None:
    """One line on stderr when "auto" measured (or read) a cost: what it chose and why."""
    if choice.setting == AUTO and choice.cost is not None:
        state = "on (greedy output equals AR's bit for bit)" if choice.on else "off"
        print(f"specdec: batch_invariant='auto': {choice.reason}: {state}", file=sys.stderr)
