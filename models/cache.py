"""The KV cache: per layer K and V `[B, H_kv, C, D]` (stored as one `[L, B, H_kv, C, D]` tensor each),
plus per row `start[i]` and `length[i]`: row i's logical token t lives at column `start[i] + t`.

Two layouts share this class (see docs/design.md):

- left-padded (rectangular): `start[i] = W - length[i]`, every row ends at the same column;
- ragged: `start[i] = 0`, rows grow at their own columns and nothing ever moves.

The cache is model-agnostic storage: a model's forward asks `plan(T, num_new)` for positions, write
columns and the attention mask, writes its per-token state into the columns, then calls `advance`.
"""
from __future__ import annotations

import torch

from specdec.kernels.positions import StepPlan, step_plan

LAYOUTS = ("left", "ragged")


class KVCache:
    def __init__(self, k, v, start, length, layout: str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.k = k  # [L, B, H_kv, C, D]
        self.v = v  # [L, B, H_kv, C, D]
        self.start = start  # [B] int64
        self.length = length  # [B] int64
        self.layout = layout

    @classmethod
    def allocate(cls, num_layers, batch_size, num_kv_heads, capacity, head_dim, dtype, device, layout="ragged"):
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        zeros = torch.zeros(batch_size, dtype=torch.int64, device=device)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   zeros, zeros.clone(), layout)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def left_padded(self) -> bool:
        return self.layout == "left"

    def set_prefill(self, prompt_lengths: torch.Tensor, width: int) -> None:
        """Prepare an empty cache for a prefill of `width` tokens per row (`prompt_lengths`: [B])."""
        self.length = torch.zeros_like(prompt_lengths)
        self.start = (width - prompt_lengths) if self.left_padded else torch.zeros_like(prompt_lengths)

    def plan(self, T: int, num_new: torch.Tensor | None = None, backend: str | None = None) -> StepPlan:
        """Positions, write columns and mask for T new tokens per row (`num_new[i]` real ones)."""
        if self.left_padded and num_new is not None and bool(((num_new < T) & (self.length > 0)).any()):
            raise ValueError("left-padded layout: rows with fewer than T new tokens are only allowed in prefill")
        plan = step_plan(self.start, self.length, T, num_new, self.left_padded, backend)
        if plan.width > self.capacity:
            raise ValueError(f"KV cache overflow: step needs {plan.width} columns, capacity is {self.capacity}")
        return plan

    def advance(self, plan: StepPlan) -> None:
        self.length = self.length + plan.num_new

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Compact the batch to `rows` ([b] int64), e.g. dropping finished sequences (one copy, once)."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)
        self.start = self.start.index_select(0, rows)
        self.length = self.length.index_select(0, rows)

    def load_rows(self, rows: torch.Tensor, other: "KVCache") -> None:
        """Copy every row of `other` (a freshly prefilled cache) into rows `rows` of this one."""
        width = int((other.start + other.length).max())
        self.k[:, rows, :, :width] = other.k[:, :, :, :width]
        self.v[:, rows, :, :width] = other.v[:, :, :, :width]
        self.start[rows] = other.start
        self.length[rows] = other.length
