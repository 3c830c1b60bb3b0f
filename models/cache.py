"""The KV cache: per layer K and V `[B, H_kv, C, D]` (stored as one `[L, B, H_kv, C, D]` tensor each),
plus per row `start[i]` and `length[i]`: row i's logical token t lives at column `start[i] + t`.

Two layouts share this class (see docs/design.md):

- left-padded (rectangular, `LEFT_PADDED`): `start[i] = W - length[i]`, every row ends at one column;
- ragged (`RAGGED`): `start[i] = 0`, rows grow at their own columns and nothing ever moves.

`start` and `length` live on the cache's device (the forward reads them there) and are mirrored on the
host (`host_start`, `host_length`: lists of ints) so that the runtime can size every step -- the attention
width, whether the write columns are contiguous -- without reading the device. Whoever changes one side
changes the other in the same call (`set_rows`, `advance`, `keep_rows`, `load_rows`); nothing here
synchronises with the device.

The cache is model-agnostic storage: a model's forward asks `plan(T, num_new)` for positions, write
columns and the attention mask, writes its per-token state into the columns, then calls `advance`.
"""
from __future__ import annotations

import torch

from specdec.kernels.positions import StepPlan, step_plan

LEFT_PADDED = "left"
RAGGED = "ragged"
LAYOUTS = (LEFT_PADDED, RAGGED)


def _as_host(values) -> list[int]:
    """A host list of ints from a list or a tensor (reading a tensor synchronises: tools and tests only)."""
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]


class KVCache:
    def __init__(self, k, v, start, length, layout: str, host_start=None, host_length=None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.k = k  # [L, B, H_kv, C, D]
        self.v = v  # [L, B, H_kv, C, D]
        self.layout = layout
        self._start = start  # [B] int64, device
        self._length = length  # [B] int64, device
        self.host_start = _as_host(start if host_start is None else host_start)
        self.host_length = _as_host(length if host_length is None else host_length)
        self.backend: str | None = None  # kernel backend of `plan` (None: $SPECDEC_KERNELS / auto)

    @classmethod
    def allocate(cls, num_layers, batch_size, num_kv_heads, capacity, head_dim, dtype, device, layout=RAGGED):
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        zeros = torch.zeros(batch_size, dtype=torch.int64, device=device)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   zeros, zeros.clone(), layout, [0] * batch_size, [0] * batch_size)

    # -------------------------------------------------------------------------------- row state
    @property
    def start(self) -> torch.Tensor:
        return self._start

    @start.setter
    def start(self, value: torch.Tensor) -> None:  # tools and tests: reads the device once
        self._start, self.host_start = value, _as_host(value)

    @property
    def length(self) -> torch.Tensor:
        return self._length

    @length.setter
    def length(self, value: torch.Tensor) -> None:  # tools and tests: reads the device once
        self._length, self.host_length = value, _as_host(value)

    def set_rows(self, start=None, host_start=None, length=None, host_length=None) -> None:
        """Replace start and/or length: the device tensor [B] and its host list together (no sync)."""
        if start is not None:
            self._start, self.host_start = start, list(host_start)
        if length is not None:
            self._length, self.host_length = length, list(host_length)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def left_padded(self) -> bool:
        return self.layout == LEFT_PADDED

    @property
    def host_end(self) -> list[int]:
        """One past each row's last cached column."""
        return [s + n for s, n in zip(self.host_start, self.host_length)]

    def set_prefill(self, prompt_lengths, width: int) -> None:
        """Prepare an empty cache for a prefill of `width` tokens per row (`prompt_lengths`: [B] list)."""
        lengths = _as_host(prompt_lengths)
        device = self.k.device
        starts = [width - n for n in lengths] if self.left_padded else [0] * len(lengths)
        self.set_rows(torch.tensor(starts, dtype=torch.int64, device=device), starts,
                      torch.zeros(len(lengths), dtype=torch.int64, device=device), [0] * len(lengths))

    # ------------------------------------------------------------------------------------- step
    def plan(self, T: int, num_new=None, full_width: bool = False) -> StepPlan:
        """Positions, write columns and mask for T new tokens per row (`num_new[i]` real ones; a host
        list, default T for every row). `full_width`: attend over all C columns (a shape that does not
        change from step to step, for compiled forwards) instead of the columns in use."""
        B = self.batch_size
        host_new = [T] * B if num_new is None else _as_host(num_new)
        if len(host_new) != B:
            raise ValueError(f"num_new has {len(host_new)} entries for a batch of {B}")
        if self.left_padded and any(n < T and m > 0 for n, m in zip(host_new, self.host_length)):
            raise ValueError("left-padded layout: rows with fewer than T new tokens are only allowed in prefill")
        # one past the last column written: left-padded rows end with their real tokens, ragged rows with T
        ends = [e + (n if self.left_padded else T) for e, n in zip(self.host_end, host_new)]
        width = max(ends, default=0)
        if width > self.capacity:
            raise ValueError(f"KV cache overflow: step needs {width} columns, capacity is {self.capacity}")
        device = self._start.device
        new = (torch.full((B,), T, dtype=torch.int64, device=device) if num_new is None
               else torch.tensor(host_new, dtype=torch.int64, device=device))  # [B]
        plan = step_plan(self._start, self._length, T, new, self.left_padded,
                         width=self.capacity if full_width else width, backend=self.backend)
        plan.host_num_new = host_new
        firsts = {e - (T - n if self.left_padded else 0) for e, n in zip(self.host_end, host_new)}
        plan.first_column = firsts.pop() if len(firsts) == 1 else None  # every row writes the same columns
        return plan

    def advance(self, plan: StepPlan) -> None:
        self._length = self._length + plan.num_new
        self.host_length = [n + m for n, m in zip(self.host_length, plan.host_num_new)]

    # ------------------------------------------------------------------------------------- rows
    def keep_rows(self, rows: list[int]) -> None:
        """Compact the batch to `rows` (host indices), e.g. dropping finished sequences (one copy, once)."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)  # [b]
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)
        self.set_rows(self._start.index_select(0, index), [self.host_start[i] for i in rows],
                      self._length.index_select(0, index), [self.host_length[i] for i in rows])

    def load_rows(self, rows: list[int], other: "KVCache") -> None:
        """Copy every row of `other` (a freshly prefilled cache) into rows `rows` (host indices) of this one."""
        width = max(other.host_end, default=0)
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)  # [b]
        self.k[:, index, :, :width] = other.k[:, :, :, :width]
        self.v[:, index, :, :width] = other.v[:, :, :, :width]
        self._start[index] = other.start
        self._length[index] = other.length
        for row, s, n in zip(rows, other.host_start, other.host_length):
            self.host_start[row], self.host_length[row] = s, n

    def append_rows(self, other: "KVCache") -> None:
        """Add every row of `other` (a freshly prefilled cache of the same layout) after this cache's rows."""
        if other.capacity != self.capacity:
            other.grow(self.capacity)
        self.k = torch.cat([self.k, other.k], dim=1)  # [L, B + b, H_kv, C, D]
        self.v = torch.cat([self.v, other.v], dim=1)
        self.set_rows(torch.cat([self._start, other.start]), self.host_start + other.host_start,
                      torch.cat([self._length, other.length]), self.host_length + other.host_length)

    def grow(self, capacity: int) -> None:
        """Give every row `capacity` columns (the cached columns keep their places; the new ones are zero)."""
        if capacity <= self.capacity:
            return
        L, B, H, C, D = self.k.shape
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros(L, B, H, capacity, D, dtype=old.dtype, device=old.device)  # [L, B, H_kv, C', D]
            new[:, :, :, :C] = old
            setattr(self, name, new)

    def add_rows(self, count: int) -> None:
        """`count` more empty rows (zero K/V, start = length = 0) after the existing ones."""
        L, B, H, C, D = self.k.shape
        zeros = torch.zeros(L, count, H, C, D, dtype=self.k.dtype, device=self.k.device)  # [L, count, H_kv, C, D]
        self.k = torch.cat([self.k, zeros], dim=1)
        self.v = torch.cat([self.v, zeros.clone()], dim=1)
        none = torch.zeros(count, dtype=torch.int64, device=self.k.device)  # [count]
        self.set_rows(torch.cat([self._start, none]), self.host_start + [0] * count,
                      torch.cat([self._length, none]), self.host_length + [0] * count)

    def gather_rows(self, rows: list[int], buffer: "KVCache", offsets: list[int], width: int) -> "KVCache":
        """Rows `rows` of this (ragged) cache copied into the first len(rows) rows of `buffer`, row i's
        logical token t at column offsets[i] + t: a left-padded cache over the buffer's storage. One slice
        copy per row (index_select on these strided views takes a slow path on the CPU)."""
        g = len(rows)
        k, v = buffer.k[:, :g, :, :width], buffer.v[:, :g, :, :width]  # [L, g, H_kv, width, D] views
        lengths = [self.host_length[r] for r in rows]
        for i, (row, n, o) in enumerate(zip(rows, lengths, offsets)):
            k[:, i, :, o:o + n].copy_(self.k[:, row, :, :n])
            v[:, i, :, o:o + n].copy_(self.v[:, row, :, :n])
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)  # [g]
        cache = KVCache(k, v, torch.tensor(offsets, dtype=torch.int64, device=self.k.device),
                        self._length.index_select(0, index), LEFT_PADDED, offsets, lengths)
        cache.backend = self.backend
        return cache

    def scatter_rows(self, rows: list[int], batch: "KVCache", firsts: list[int]) -> None:
        """The inverse of `gather_rows` after a step: copy each batch row i's logical columns
        firsts[i]..length back into row rows[i] (start = 0), and its length."""
        for i, (row, first, n) in enumerate(zip(rows, firsts, batch.host_length)):
            src = batch.host_start[i] + first
            self.k[:, row, :, first:n].copy_(batch.k[:, i, :, src:src + n - first])
            self.v[:, row, :, first:n].copy_(batch.v[:, i, :, src:src + n - first])
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)  # [g]
        self._length.index_copy_(0, index, batch.length)
        for row, n in zip(rows, batch.host_length):
            self.host_length[row] = n
