"""CUDA graphs of a model's step: one place that runs a captured forward (issue 41).

A decode or verify step of B rows and T tokens each (every row T real tokens: no prefill padding) runs as
one replay of a graph captured for (rows bucket, T, the cache's storage), the way gpt-fast and nano-vllm
run decoding: launching ~40 kernels a layer from Python costs more than the kernels themselves at small
batches. What makes the step capturable (models/transformer.py):

- static inputs: the token ids `[Bb, T]`, each row's `start` and `length` `[Bb]` (copied in before each
  replay; Bb = the bucket: 1, 2, 4, 8, 16 or 32 rows), the cache's storage (allocated before, written in
  place: a graph is keyed by the storage's address, so a cache that grows gets new graphs) and the RoPE
  tables (inputs of the forward, sized for the cache's capacity);
- positions, write columns and the mask computed on the device from start/length, over the cache's full
  capacity (no shape follows the rows' lengths), and no Python decision on a device value;
- the bucket's extra rows (B..Bb-1 of the storage) have start = length = 0: they write their garbage at
  columns 0..T-1 of storage rows no request uses (the batch's rows are always the storage's first B), and
  their logits are dropped.

`GraphRunner.run` returns None where it does not apply (prefill, a padded step, hidden states asked for,
more rows than the largest bucket, fewer storage rows than the bucket): the caller runs eager. On a device
without CUDA graphs (`capture=False`: the CPU, in the tests) the same static-buffer path runs eagerly, so
what the graph computes is tested everywhere; only the capture itself needs a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BUCKETS = (1, 2, 4, 8, 16, 32)
WARMUP_RUNS = 2  # eager runs of a shape before its capture (lazy inits, Triton's compilation, cuBLAS handles)


@dataclass
class CapturedStep:
    """One graph's static buffers: inputs copied in, outputs read out after each replay."""

    ids: torch.Tensor  # [Bb, T] int64
    start: torch.Tensor  # [Bb] int64
    length: torch.Tensor  # [Bb] int64
    logits: torch.Tensor | None = None  # [Bb, T or 1, V], written by the replay
    graph: object = None  # torch.cuda.CUDAGraph, None while warming up (or without capture)
    runs: int = 0


class GraphRunner:
    """Runs a `Transformer`'s plain steps through CUDA graphs captured per (bucket, T, logits, storage)."""

    def __init__(self, model, buckets=BUCKETS, capture: bool | None = None):
        self.model = model
        self.buckets = tuple(sorted(buckets))
        self.capture = model.device.type == "cuda" if capture is None else bool(capture)
        self.steps: dict[tuple, CapturedStep] = {}
        self.pool = None  # one memory pool for every graph (torch.cuda.graph_pool_handle)
        self.failed: str | None = None  # why capturing failed once (the runner then stays eager)

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    @torch.no_grad()
    def run(self, input_ids, cache, logits: str, hidden, num_new, features):
        """The step's logits ([B, T, V] or [B, 1, V] for "last"), with the cache advanced; None where the step
        is not one a graph runs (the caller runs it eager)."""
        B, T = input_ids.shape
        Bb = self.bucket(B)
        if (self.failed or num_new is not None or hidden is not None or features is not None or Bb is None
                or cache.reserved_rows < Bb or any(n + T > cache.capacity for n in cache.host_end)):
            return None
        storage = cache._kv_all
        if not storage.is_contiguous():  # a view of another cache's storage (exspec's batch buffer): eager
            return None
        key = (Bb, T, logits, storage.data_ptr(), tuple(storage.shape), storage.dtype, cache.backend)
        step = self.steps.get(key)
        if step is None:
            device = input_ids.device
            step = self.steps[key] = CapturedStep(torch.zeros(Bb, T, dtype=torch.int64, device=device),
                                                  torch.zeros(Bb, dtype=torch.int64, device=device),
                                                  torch.zeros(Bb, dtype=torch.int64, device=device))
        step.ids[:B].copy_(input_ids)
        step.start[:B].copy_(cache.start)
        step.length[:B].copy_(cache.length)
        if B < Bb:  # the padded rows write at columns 0..T-1 of their (unused) storage rows, whatever ran before
            step.start[B:].zero_()
            step.length[B:].zero_()
        kv = storage[:, :, :Bb]  # [L, 2, Bb, H_kv, C, D]: the rows in use, then unused storage rows
        tables = self.model.rope_head_table(cache.capacity)
        if step.graph is not None:
            step.graph.replay()
        elif not self.capture or step.runs < WARMUP_RUNS:
            step.logits = self._forward(step, kv, T, logits, tables, cache.backend)
            step.runs += 1
        else:
            self._capture(step, kv, T, logits, tables, cache.backend)
        cache.advance_rows(T)
        return step.logits[:B]

    def _forward(self, step: CapturedStep, kv, T: int, logits: str, tables, backend):
        """The captured computation: the plan from start/length on the device, then the forward."""
        model = self.model
        C = kv.shape[4]
        index = step.length[:, None] + torch.arange(T, device=kv.device)  # [Bb, T] logical index
        columns = step.start[:, None] + index  # [Bb, T]
        visible = torch.arange(C, device=kv.device)  # [C]
        mask = (visible >= step.start[:, None, None]) & (visible <= columns[:, :, None])  # [Bb, T, C]
        return model.forward_tensors(step.ids, kv, index, columns, mask, None, logits == "last", backend, None, None,
                                     False, tables)

    def _capture(self, step: CapturedStep, kv, T: int, logits: str, tables, backend) -> None:
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool):
                step.logits = self._forward(step, kv, T, logits, tables, backend)
            step.graph = graph
            graph.replay()  # capturing recorded the kernels without running them
        except Exception as err:  # noqa: BLE001 -- a capture that fails leaves the model eager, said once
            self.failed = f"{type(err).__name__}: {err}"
            import warnings

            warnings.warn(f"CUDA graph capture failed, running eager: {self.failed}", RuntimeWarning, stacklevel=3)
            step.logits = self._forward(step, kv, T, logits, tables, backend)
