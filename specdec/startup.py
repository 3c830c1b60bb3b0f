"""The start-up measurement: the forwards the runtime times before it serves -- `--threads auto`'s thread
count (specdec/openmp.py), `batch_invariant="auto"`'s cost of the mode (specdec/bi_mode.py) and auto k's
forward-cost tables (specdec/autok.py) -- with one warm-up per model, one cache file and one line for the
run summary. Those modules keep their rules (which count wins, when the mode pays, the cost table); their
timing and caching go through a `StartupMeasurement` that their caller creates and passes (an `LLM` holds
one for its models; a call given none makes its own, sharing no warm-up and adding to no summary).

- **Warm-up.** A model's first forward in a way it runs pays one-off costs that a step does not (allocations,
  kernel and plan selection, a compile). `StartupMeasurement.time_forward` runs one untimed forward the first
  time it sees a model run a way (`warm_up_key`: its forward variant and torch's thread count, both of which
  choose other kernels; with a compiled forward, each of torch.compile's size-1 specialisations) and none
  after. A forward replayed as CUDA graphs still captures each new shape untimed (specdec/timing.py).
- **Cache.** One JSON file (`cost_cache`; default `default_cache_path()`, "" keeps none), one entry per
  measurement, keyed (`cache_key`) by what was measured, the host (`host_name`: the GPU on CUDA, the CPU
  model elsewhere), torch's version, the models (`model_identity`: their checkpoint files; model objects are
  not cached), dtype and torch's thread count, then the measurement's own shape. A measurement may check a
  cached entry before it is trusted (auto k and the thread count time a spot check, `within_factor`).
- **Summary.** Each measurement records what it found and how long it took, cached or not; `summary_lines`
  are the run summary's lines: the one figure (every measurement's seconds) and a line per finding.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from typing import Callable, NamedTuple

import torch

from specdec import timing

CACHE_VERSION = 1  # the key's layout: entries of another layout are measured again
SPOT_CHECK_FACTOR = 1.5  # a cached time is trusted while a new timing is within this factor of it


# ---------------------------------------------------------------------------------------------- identity
def default_cache_path() -> str:
    """~/.cache/specdec/costs.json, under $XDG_CACHE_HOME if set."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specdec", "costs.json")


def cpu_name() -> str:
    """The CPU model (/proc/cpuinfo's "model name"), else what `platform` knows of the processor."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def host_name(device) -> str:
    """What the timings are of: the GPU's name for a CUDA device, the CPU model elsewhere."""
    if torch.device(device).type == "cuda":
        try:
            return torch.cuda.get_device_name(torch.device(device))
        except (RuntimeError, AssertionError):  # no driver (tests)
            return str(device)
    return cpu_name()


def model_identity(model, spec) -> str | None:
    """What identifies a model's costs: its checkpoint files (path, size, mtime) and config; None for
    model objects given directly (their costs are not cached)."""
    if not isinstance(spec, (str, os.PathLike)):
        return None
    path = os.path.realpath(os.fspath(spec))
    if os.path.isfile(path):  # a single-file checkpoint (.gguf)
        st = os.stat(path)
        return hashlib.sha256(f"{path}|{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    parts = [path]
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".json")):
            st = os.stat(os.path.join(path, name))
            parts.append(f"{name}:{st.st_size}:{int(st.st_mtime)}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def forward_variant(model) -> str:
    """How a model's forward runs, as far as its cost goes: eager or compiled, replayed CUDA graphs or not,
    batch-invariant or not, packed linear weights or not."""
    runner = getattr(model, "graph_runner", None)
    graphs = runner is not None and getattr(runner, "capture", False) and not getattr(runner, "failed", None) \
        and getattr(model, "compiled_forward", None) is None  # (a compiled forward runs without the runner)
    invariant = bool(getattr(model, "batch_invariant", False))
    compiled = getattr(model, "compiled_forward", None) is not None and not invariant  # the mode runs eager
    packed = bool(getattr(model, "packed_linear", False)) and not invariant and not compiled
    quantized = getattr(model, "quantize", None)  # int8 / int4 weights (models/quant.py) cost other times
    native = getattr(model, "native", None) is not None  # the native CPU forward (models/native.py)
    head = getattr(model, "head_ids", None)  # a head restricted to a subset of the vocabulary (restrict_head)
    parts = ["native" if native else "compiled" if compiled else "eager", "+graphs" if graphs else "",
             "+batch-invariant" if invariant and not native else "", "+packed" if packed else "",
             f"+{quantized}" if quantized else "", f"+head{head.numel()}" if head is not None else ""]
    return "".join(parts)


def warm_up_key(model, rows: int, new_tokens: int, logits: str) -> tuple:
    """What a model's first forward pays for once: the model (by id: the measurement lives no longer than its
    models), its forward variant and torch's thread count; a compiled forward also compiles one graph per
    size-1 specialisation of rows and new tokens, and per logits mode."""
    variant = forward_variant(model)
    compiled = (rows == 1, new_tokens == 1, logits) if variant.startswith("compiled") else ()
    return (id(model), variant, torch.get_num_threads(), *compiled)


def cache_key(what: str, model_ids: list[str], dtype, device, *details) -> str:
    """The cache entry of measurement `what` of the models `model_ids` (`model_identity`s) in `dtype` on
    `device`'s host at torch's current thread count; `details`: the measurement's own shape."""
    parts = [what, f"v{CACHE_VERSION}", host_name(device), f"torch={torch.__version__}", *model_ids, str(dtype),
             f"threads={torch.get_num_threads()}", *map(str, details)]
    return "/".join(parts)


def within_factor(measured: float, expected: float, factor: float = SPOT_CHECK_FACTOR) -> bool:
    """Whether `measured` seconds are within `factor` of `expected` (either way): a spot check of a cached time."""
    return expected / factor <= measured <= expected * factor


# ------------------------------------------------------------------------------------------------- file
def read_entries(path: str) -> dict:
    """Every entry of the cache file ({} without a file, or for one that is not a JSON object)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_entry(path: str, key: str):
    """The JSON value at `key` in the cache file, or None (no file, no entry, not JSON)."""
    return read_entries(path).get(key)


def write_entry(path: str, key: str, value) -> None:
    """Best effort (a read-only home must not stop a run): merge the entry into the JSON file atomically."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        data = read_entries(path)
        data[key] = value
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------ measurement
class Measured(NamedTuple):
    """One measurement's record for the summary: what it found, its wall seconds, whether from the cache."""

    result: str
    seconds: float
    cached: bool
    key: str | None  # its cache entry (None: a model object's, never cached)


class StartupMeasurement:
    """The start-up measurement of one `LLM` (or program): `time_forward` warms each model up once per way it
    runs, `measure` reads or takes a measurement through the one cache file, `summary_lines` say what was
    measured.
    `cache_path`: the cache file (None: `default_cache_path()`, "": none)."""

    def __init__(self, cache_path: str | None = None):
        self.cache_path = default_cache_path() if cache_path is None else cache_path
        self.warmed: set[tuple] = set()  # `warm_up_key`s whose warm-up has run
        self.records: list[Measured] = []

    def time_forward(self, model, rows: int, new_tokens: int, context: int, repeats: int, logits: str = "all",
                     vocab: int | None = None) -> tuple[float, float]:
        """`timing.time_forward` (median seconds, seconds before the timed forwards) in inference mode, with its
        untimed warm-up forward only the first time `model` runs the way it runs now (`warm_up_key`)."""
        key = warm_up_key(model, rows, new_tokens, logits)
        with torch.inference_mode():
            result = timing.time_forward(model, rows, new_tokens, context, repeats, logits, vocab=vocab,
                                         warm_up=key not in self.warmed)
        self.warmed.add(key)
        return result

    def measure(self, key: str | None, run: Callable[[], object], decode: Callable[[object], object],
                describe: Callable[[object], str], encode: Callable[[object], object] = lambda value: value,
                check: Callable[[object], bool] | None = None) -> tuple[object, bool]:
        """(value, whether it came from the cache): the cache entry at `key` as `decode` reads it, if there is
        one and `check` (a spot check, timed here too) accepts it; else `run()`, stored at `key` as
        `encode` writes it. key None: measured, not stored. Recorded with `describe(value)` and its seconds."""
        started = time.perf_counter()
        value = self.load(key, decode)
        cached = value is not None and (check is None or check(value))
        if not cached:
            value = run()
            if key is not None and self.cache_path:
                write_entry(self.cache_path, key, encode(value))
        self.records.append(Measured(describe(value), time.perf_counter() - started, cached, key))
        return value, cached

    def load(self, key: str | None, decode: Callable[[object], object]):
        """The decoded cache entry at `key`, or None (no key, no cache file, no entry, or one `decode` refuses)."""
        if key is None or not self.cache_path:
            return None
        entry = read_entry(self.cache_path, key)
        try:
            return None if entry is None else decode(entry)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    @property
    def seconds(self) -> float:
        """Wall seconds of every measurement so far, cached ones (their reads and spot checks) included."""
        return sum(r.seconds for r in self.records)

    def summary_lines(self) -> list[str]:
        """The run summary's lines: `start-up measurement: S s (not counted in tokens/s or latencies)` (the one
        figure: every measurement's seconds, the cached ones' reads and spot checks included), then one indented
        line per finding (the thread count, the batch-invariant cost, each auto-k cost table), "(cached)" where
        read from the cache; [] when nothing was measured."""
        if not self.records:
            return []
        said, seen = [], set()  # each finding once: one read back later in the run (its key again) is not repeated
        for r in self.records:
            ident = r.key if r.key is not None else r.result
            if ident not in seen:
                seen.add(ident)
                said.append("  " + r.result + (" (cached)" if r.cached else ""))
        return [f"start-up measurement: {self.seconds:.2f} s (not counted in tokens/s or latencies)", *said]
