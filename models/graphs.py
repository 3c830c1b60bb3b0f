"""CUDA graphs of a model's step: the one mechanism that captures a forward (issues 41, 50).

A decode or verify step of B rows and T tokens each (every row T real tokens: no prefill padding) runs as
one replay of a graph captured for (rows bucket, T, attention width bucket, what it returns) on the cache's
storage, the way gpt-fast and nano-vllm run decoding: launching ~40 kernels a layer from Python costs more
than the kernels themselves at small batches. What makes the step capturable (models/transformer.py):

- static inputs: the token ids `[Bb, T]`, each row's `start` and `length` `[Bb]` and a feature draft's
  features `[Bb, T, E]` (copied in before each replay; Bb = the bucket: 1, 2, 4, 8, 16 or 32 rows), the
  storage's first W columns (written in place) and the RoPE tables;
- positions, write columns and the mask computed on the device from start/length, over W columns: the width
  in use rounded up to a power of two (at least WIDTH_MIN, at most the capacity), so attention reads what
  eager reads, up to twice, however long the cache; no Python decision on a device value;
- the bucket's extra rows (B..Bb-1 of the storage) have start = length = 0: they write their garbage at
  columns 0..T-1 of storage rows no request uses (the batch's rows are always the storage's first B; a
  cache's storage has its bucket's rows: `reserve`, at allocation), and their outputs are dropped.

Lifetime: a graph belongs to the storage it captured (`KVCache.graphs`, dropped when the cache moves to a
new storage or is freed: graphs live exactly as long as their cache), holds the tables it read (a graph whose
tables were regrown is released and captured again against the live ones), and a runner keeps at most
`max_graphs` of them (least recently used released first). An exspec group is a view of its step buffer: its
graphs belong to the buffer (`KVCache.owner`). `reserve_bytes` is what they may hold, for the admission check
(specdec/memory.py).

`GraphRunner.takes` says where a graph does not apply (a padded prefill, more than MAX_TOKENS tokens per row,
more rows than the largest bucket, a view without its bucket's rows): the model runs that step eager. `capture`
is the graph API (`torch.cuda` on CUDA; tests pass a CPU stand-in, tests/graph_standin.py); without one
(`capture=False`) the same static-buffer path runs eagerly, so what the graph computes is tested everywhere.
"""
from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

BUCKETS = (1, 2, 4, 8, 16, 32)
WARMUP_RUNS = 2  # eager runs of a shape before its capture (lazy inits, Triton's compilation, cuBLAS handles)
MAX_GRAPHS = 32  # graphs a runner keeps (a run's steps use a few row buckets x k + 1 lengths x width buckets)
MAX_TOKENS = 16  # longer steps (prefills) run eager: their kernels, not their launches, take the time
WIDTH_MIN = 64  # the narrowest attention width a graph is captured for
_SERIAL = itertools.count()  # runners' ids in the graphs' keys (a cache may outlive a runner)


def width_bucket(width: int, capacity: int) -> int:
    """The columns a graph attends over for a step that needs `width`: a power of two, in [WIDTH_MIN, capacity]."""
    return min(capacity, max(WIDTH_MIN, 1 << max(width - 1, 0).bit_length()))


@dataclass
class CapturedStep:
    """One graph's static buffers: inputs copied in, outputs read out after each replay."""

    ids: torch.Tensor  # [Bb, T] int64
    start: torch.Tensor  # [Bb] int64
    length: torch.Tensor  # [Bb] int64
    features: torch.Tensor | None  # [Bb, T, E] (a feature draft's input) or None
    home: object = None  # weakref to the KVCache whose storage it runs on
    key: tuple = ()
    out: object = None  # logits [Bb, T or 1, V] (or with hidden states: a pair), written by the replay
    graph: object = None  # the captured graph, None while warming up (or without capture)
    tables: tuple | None = None  # the RoPE tables it captured (held: a graph reads them by address)
    kv: torch.Tensor | None = None  # the storage view it captured (held, as the cache holds it)
    runs: int = 0

    def drop_graph(self) -> None:
        """Drop the graph and its outputs (the static inputs stay: the next run captures again)."""
        if self.graph is not None and hasattr(self.graph, "reset"):
            self.graph.reset()
        self.graph = self.out = self.tables = self.kv = None

    def release(self) -> None:
        """Drop the graph and its outputs, and leave the cache's graphs."""
        self.drop_graph()
        self.runs = 0
        home = self.home() if self.home is not None else None
        if home is not None and home.graphs.get(self.key) is self:
            del home.graphs[self.key]


class GraphRunner:
    """Runs a `Transformer`'s plain steps through CUDA graphs captured per (bucket, T, width, outputs, storage)."""

    def __init__(self, model, buckets=BUCKETS, capture=None, max_graphs: int = MAX_GRAPHS):
        self.model = model
        self.buckets = tuple(sorted(buckets))
        if capture is None:
            capture = model.device.type == "cuda"
        self.api = torch.cuda if capture is True else (capture or None)  # the graph API (torch.cuda's names)
        self.capture = self.api is not None
        self.max_graphs = int(max_graphs)
        self.serial = next(_SERIAL)
        self._live: OrderedDict[int, weakref.ref] = OrderedDict()  # id(step) -> step, least recently used first
        self._tables = None  # the RoPE cos table the live graphs captured
        self.failed: str | None = None  # why capturing failed once (the runner then stays eager)

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def reserve(self, cache) -> None:
        """Give a new cache's storage the rows of its bucket (the padding rows of its graphed steps)."""
        Bb = self.bucket(cache.batch_size)
        if Bb is not None:
            cache.reserve_rows(Bb)

    def forwards_before_replay(self) -> int:
        """Forwards of a new shape before it replays a graph: its warm-up runs and its capture (0 without capture)."""
        return WARMUP_RUNS + 1 if self.capture and not self.failed else 0

    def live_steps(self) -> list[CapturedStep]:
        return [s for s in (ref() for ref in self._live.values()) if s is not None]

    def release_all(self) -> None:
        """Release every graph (each is captured again at its next step: its warm-up is done)."""
        for step in self.live_steps():
            step.drop_graph()

    def reserve_bytes(self, rows: int, capacity: int, tokens: int) -> int:
        """Device memory this runner's graphs may hold at most for steps of `rows` rows and up to `tokens` tokens
        over `capacity` columns: every kept graph's outputs, and one forward's activations (their pool)."""
        cfg = getattr(self.model, "cfg", None)
        if cfg is None or not self.capture:
            return 0
        Bb, T = self.bucket(rows) or rows, min(tokens, MAX_TOKENS)
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        E, V, I = cfg.hidden_size, self.model.vocab_size, cfg.intermediate_size
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        outputs = Bb * T * (V + E) * itemsize  # logits and hidden states
        activations = Bb * T * (V + 2 * I + (H + 2 * Hkv) * D + 4 * E + 2 * H * capacity) * itemsize
        return self.max_graphs * outputs + activations

    def takes(self, input_ids, cache, num_new) -> bool:
        """Whether a graph runs this step of input_ids [B, T]: every row T real tokens (`num_new` None), at most
        MAX_TOKENS of them, at most the largest bucket's rows, room for them in the cache, and the bucket's rows in
        the storage (a cache that is its own storage gets them in `run`); never after a failed capture."""
        B, T = input_ids.shape
        Bb = self.bucket(B)
        if (self.failed or num_new is not None or Bb is None or T > MAX_TOKENS
                or any(n + T > cache.capacity for n in cache.host_end)):
            return False
        return cache.owner is None or cache.owner.reserved_rows >= Bb  # exspec's group: a view of the step buffer

    @torch.no_grad()
    def run(self, input_ids, cache, logits: str, hidden, features):
        """The logits of a step the runner `takes` ([B, T, V] or [B, 1, V] for "last"; with `hidden`, the pair),
        with the cache advanced."""
        B, T = input_ids.shape
        Bb = self.bucket(B)
        home = cache.owner if cache.owner is not None else cache  # exspec's group: a view of the step buffer
        if home is cache and cache.reserved_rows < Bb:
            cache.reserve_rows(Bb)  # one copy, once per storage (a cache not allocated by `new_cache`)
        storage = home._kv_all  # [L, 2, R, H_kv, C, D]
        W = width_bucket(max(cache.host_end) + T, storage.shape[4])
        tables = self.model.rope_head_table(storage.shape[4])
        if tables[0] is not self._tables:  # regrown: every graph that read the old tables goes
            self.release_all()
            self._tables = tables[0]
        key = (self.serial, Bb, T, W, logits, hidden, features is not None, cache.backend)
        step = home.graphs.get(key)
        if step is None:
            step = self._new_step(home, key, input_ids, features)
        if id(step) in self._live:
            self._live.move_to_end(id(step))
        step.ids[:B].copy_(input_ids)
        step.start[:B].copy_(cache.start)
        step.length[:B].copy_(cache.length)
        if features is not None:
            step.features[:B].copy_(features)
        if B < Bb:  # the padded rows write at columns 0..T-1 of their (unused) storage rows, whatever ran before
            step.start[B:].zero_()
            step.length[B:].zero_()
        kv = storage[:, :, :Bb, :, :W]  # [L, 2, Bb, H_kv, W, D]: the rows in use, then unused storage rows
        if step.graph is not None:
            step.graph.replay()
        elif not self.capture or step.runs < WARMUP_RUNS:
            step.out = self._forward(step, kv, T, logits, hidden, tables, cache.backend)
            step.runs += 1
        else:
            self._capture(step, home, kv, T, logits, hidden, tables, cache.backend)
        cache.advance_rows(T)
        if hidden is not None:
            return step.out[0][:B], step.out[1][:B]
        return step.out[:B]

    def _new_step(self, home, key, input_ids, features) -> CapturedStep:
        Bb, T = key[1], key[2]
        device = input_ids.device
        feats = None if features is None else torch.zeros(Bb, T, features.shape[-1], dtype=features.dtype,
                                                           device=device)  # [Bb, T, E]
        step = CapturedStep(torch.zeros(Bb, T, dtype=torch.int64, device=device),
                            torch.zeros(Bb, dtype=torch.int64, device=device),
                            torch.zeros(Bb, dtype=torch.int64, device=device), feats, weakref.ref(home), key)
        home.graphs[key] = step
        key_id = id(step)
        self._live[key_id] = weakref.ref(step, lambda _, k=key_id, live=self._live: live.pop(k, None))
        while len(self._live) > self.max_graphs:  # the least recently used goes
            _, ref = self._live.popitem(last=False)
            old = ref()
            if old is not None:
                old.release()
        return step

    def _forward(self, step: CapturedStep, kv, T: int, logits: str, hidden, tables, backend):
        """The captured computation: the plan from start/length on the device, then the forward."""
        W = kv.shape[4]
        index = step.length[:, None] + torch.arange(T, device=kv.device)  # [Bb, T] logical index
        columns = step.start[:, None] + index  # [Bb, T]
        visible = torch.arange(W, device=kv.device)  # [W]
        mask = (visible >= step.start[:, None, None]) & (visible <= columns[:, :, None])  # [Bb, T, W]
        return self.model.forward_tensors(step.ids, kv, index, columns, mask, None, logits == "last", backend,
                                          step.features, hidden, False, tables)

    def _capture(self, step: CapturedStep, home, kv, T: int, logits: str, hidden, tables, backend) -> None:
        api = self.api
        try:
            pool = home.graphs.get("pool")  # one memory pool per storage: released with its graphs
            if pool is None:
                pool = home.graphs["pool"] = api.graph_pool_handle()
            graph = api.CUDAGraph()
            api.synchronize()
            with api.graph(graph, pool=pool):
                out = self._forward(step, kv, T, logits, hidden, tables, backend)
            step.graph, step.out, step.tables, step.kv = graph, out, tables, kv
            graph.replay()  # capturing recorded the kernels without running them
        except Exception as err:  # noqa: BLE001 -- a capture that fails leaves the model eager, said once
            self.failed = f"{type(err).__name__}: {err}"
            import warnings

            warnings.warn(f"CUDA graph capture failed, running eager: {self.failed}", RuntimeWarning, stacklevel=3)
            step.graph = None
            step.out = self._forward(step, kv, T, logits, hidden, tables, backend)
