"""The KV cache: per layer K and V `[B, H_kv, C, D]`, stored together as one `[L, 2, B, H_kv, C, D]` tensor
(`kv`; `k` and `v` are its views `[L, B, H_kv, C, D]`, so a forward writes a layer's K and V with one op),
plus per row `start[i]` and `length[i]`: row i's logical token t lives at column `start[i] + t`.

Two layouts share this class (see docs/design.md):

- left-padded (rectangular, `LEFT_PADDED`): `start[i] = W - length[i]`, every row ends at one column;
- ragged (`RAGGED`): `start[i] = 0`, rows grow at their own columns and nothing ever moves.

`start` and `length` live on the cache's device (the forward reads them there) and are mirrored on the
host (`host_start`, `host_length`: lists of ints) so that the runtime can size every step -- the attention
width, whether the write columns are contiguous -- without reading the device. Whoever changes one side
changes the other in the same call (`set_rows`, `advance`, `take_rows`, `load_rows`, `resize_rows`); nothing here
synchronises with the device.

The cache is model-agnostic storage: a model's forward asks `plan(T, num_new)` for positions, write
columns and the attention mask, writes its per-token state into the columns, then calls `advance`.
"""
from __future__ import annotations

import torch

from specdec.kernels.positions import StepPlan, step_plan
from specdec.kernels.realign import realign

LEFT_PADDED = "left"
RAGGED = "ragged"
LAYOUTS = (LEFT_PADDED, RAGGED)


def _as_host(values) -> list[int]:
    """A host list of ints from a list or a tensor (reading a tensor synchronises: tools and tests only)."""
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]


class KVCache:
    def __init__(self, kv, start, length, layout: str, host_start=None, host_length=None):
        """kv: [L, 2, B, H_kv, C, D] (K at index 0 of dim 1, V at 1), rows in use = all B."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self._use(kv, kv.shape[2])  # self.kv [L, 2, B, H_kv, C, D]; self.k, self.v: [L, B, H_kv, C, D]
        self.layout = layout
        self._start = start  # [B] int64, device
        self._length = length  # [B] int64, device
        self.host_start = _as_host(start if host_start is None else host_start)
        self.host_length = _as_host(length if host_length is None else host_length)
        self.backend: str | None = None  # the kernels' backend for steps on this cache (None: auto)
        self.owner: KVCache | None = None  # the cache whose storage this one is a view of (`gather_rows`)

    @classmethod
    def allocate(cls, num_layers, batch_size, num_kv_heads, capacity, head_dim, dtype, device, layout=RAGGED):
        shape = (num_layers, 2, batch_size, num_kv_heads, capacity, head_dim)
        zeros = torch.zeros(batch_size, dtype=torch.int64, device=device)
        return cls(torch.zeros(shape, dtype=dtype, device=device), zeros, zeros.clone(), layout, [0] * batch_size,
                   [0] * batch_size)

    # -------------------------------------------------------------------------------- row state
    @property
    def start(self) -> torch.Tensor:
        """[B] int64 on the device (`set_rows` changes it with its host mirror)."""
        return self._start

    @property
    def length(self) -> torch.Tensor:
        """[B] int64 on the device (`set_rows` changes it with its host mirror)."""
        return self._length

    def set_rows(self, start=None, host_start=None, length=None, host_length=None) -> None:
        """Replace start and/or length: the device tensor [B] and its host list together (no sync)."""
        if start is not None:
            self._start, self.host_start = start, list(host_start)
        if length is not None:
            self._length, self.host_length = length, list(host_length)

    @property
    def batch_size(self) -> int:
        return self.kv.shape[2]

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

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
    def plan(self, T: int, num_new=None, full_width: bool = False, mask: bool = True) -> StepPlan:
        """Positions, write columns and mask for T new tokens per row (`num_new[i]` real ones; a host
        list, default T for every row). `full_width`: attend over all C columns (a shape that does not
        change from step to step, for compiled forwards) instead of the columns in use. `mask` False: no
        mask (the forward knows when attention needs none)."""
        B = self.batch_size
        host_new, width = self.step_rows(T, num_new)
        device = self._start.device
        new = (torch.full((B,), T, dtype=torch.int64, device=device) if num_new is None
               else torch.tensor(host_new, dtype=torch.int64, device=device))  # [B]
        plan = step_plan(self._start, self._length, T, new, self.left_padded,
                         width=self.capacity if full_width else width, backend=self.backend, mask=mask)
        plan.host_num_new = host_new
        return plan

    def step_rows(self, T: int, num_new=None) -> tuple[list[int], int]:
        """(real new tokens per row as a host list, the columns the step spans): a step of T new tokens per row
        (`num_new[i]` real ones, default T) checked against the layout and the capacity."""
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
        return host_new, width

    def advance(self, plan: StepPlan) -> None:
        self.advance_host(plan.host_num_new, plan.num_new)

    def advance_host(self, host_new: list[int], num_new: torch.Tensor | None = None) -> None:
        """Every row i cached host_new[i] more tokens (`num_new`: the same on the device, when the caller has it)."""
        if num_new is None:
            num_new = torch.tensor(host_new, dtype=torch.int64, device=self._length.device)  # [B]
        self._length = self._length + num_new
        self.host_length = [n + m for n, m in zip(self.host_length, host_new)]

    def advance_rows(self, T: int) -> None:
        """Every row cached T more tokens (a step planned on the device: models/graphs.py)."""
        self._length = self._length + T
        self.host_length = [n + T for n in self.host_length]

    def right_align(self, live: list[bool], draft: "KVCache | None" = None) -> None:
        """Left-padded layout: right-align every live row (host list of bools) at the longest live row's edge
        (invariant I6), moving this cache's and `draft`'s rows together (their rows share `start`). Rows not
        live stay where they are; only rows whose start changes are copied (`kernels/realign.py`)."""
        longest = max((n for n, a in zip(self.host_length, live) if a), default=0)
        new_host = [longest - n if a else s for n, s, a in zip(self.host_length, self.host_start, live)]
        delta_host = [new - old for new, old in zip(new_host, self.host_start)]
        if not any(delta_host):
            return
        new_start = longest - self._length  # [B]
        if not all(live):
            new_start = torch.where(torch.tensor(live, device=new_start.device), new_start, self._start)  # [B]
        delta = new_start - self._start  # [B], may be negative
        caches = [(self.k, self.v)] + ([(draft.k, draft.v)] if draft is not None else [])
        realign(caches, self._start, self._length, delta, backend=self.backend,
                host=(self.host_start, self.host_length, delta_host))
        self.set_rows(start=new_start, host_start=new_host)
        if draft is not None:
            draft.set_rows(start=new_start.clone(), host_start=list(new_host))

    # ------------------------------------------------------------------------------------- rows
    # The K/V tensors are views `[:, :B]` of a storage of `reserved_rows` >= B row slots: rows come and go
    # by moving single rows inside it (`take_rows`, `load_rows`, `resize_rows`), never by copying the
    # others; the storage itself is copied only when it must grow (`reserve_rows`, `grow`).
    @property
    def reserved_rows(self) -> int:
        return self._kv_all.shape[2]

    def _use(self, kv_all, rows: int) -> None:
        if kv_all is not getattr(self, "_kv_all", None):
            # models/graphs.py: the CUDA graphs captured on this storage (and their pool), released with it
            self.graphs: dict = {}
        self._kv_all = kv_all  # [L, 2, R, H_kv, C, D] storage
        self.kv = kv_all[:, :, :rows]  # [L, 2, B, H_kv, C, D] view: the rows in use
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]  # [L, B, H_kv, C, D] views

    def _restore(self, rows: int, capacity: int) -> None:
        """New zero storage of `rows` slots and `capacity` columns holding the rows in use (one copy of them)."""
        L, two, B, H, C, D = self.kv.shape
        new = torch.zeros(L, two, rows, H, capacity, D, dtype=self.kv.dtype, device=self.kv.device)  # [L, 2, R, H_kv, C', D]
        new[:, :, :B, :, :C] = self.kv
        self._use(new, B)

    def reserve_rows(self, rows: int) -> None:
        """Room for `rows` rows without copying the cache again (copies the rows in use once, if it grows)."""
        if rows > self.reserved_rows:
            self._restore(rows, self.capacity)

    def resize_rows(self, rows: int) -> None:
        """Use the first `rows` row slots: rows past `rows` are released, new ones are empty (start = length
        = 0; their columns hold zeros or a released row's values, finite and never attended)."""
        B = self.batch_size
        self.reserve_rows(rows)
        self._use(self._kv_all, rows)
        if rows <= B:
            self.set_rows(self._start[:rows], self.host_start[:rows], self._length[:rows], self.host_length[:rows])
        else:
            none = torch.zeros(rows - B, dtype=torch.int64, device=self.k.device)  # [rows - B]
            self.set_rows(torch.cat([self._start, none]), self.host_start + [0] * (rows - B),
                          torch.cat([self._length, none]), self.host_length + [0] * (rows - B))

    def take_rows(self, order: list[int]) -> None:
        """Row i takes row order[i]'s state (host indices, i < len(order)); rows past len(order) are released.
        Only the rows that move are copied, one slice of their cached columns each: a row may move only
        into a row that `order` drops (as compaction from the tail does)."""
        moved = [(i, j) for i, j in enumerate(order) if i != j]
        if {i for i, _ in moved} & {j for _, j in moved}:
            raise ValueError(f"take_rows: a row moves into a row that is still kept ({order})")
        for i, j in moved:
            s, n = self.host_start[j], self.host_length[j]
            self.kv[:, :, i, :, s:s + n].copy_(self.kv[:, :, j, :, s:s + n])  # [L, 2, H_kv, n, D]
        index = torch.tensor(order, dtype=torch.int64, device=self.k.device)  # [b]
        self.set_rows(self._start.index_select(0, index), [self.host_start[j] for j in order],
                      self._length.index_select(0, index), [self.host_length[j] for j in order])
        self._use(self._kv_all, len(order))

    def load_rows(self, rows: list[int], other: "KVCache", starts: list[int] | None = None) -> None:
        """Copy every row of `other` (a freshly prefilled cache) into rows `rows` (host indices) of this one:
        its cached columns only, to start at starts[i] (default: where they are in `other`)."""
        starts = list(other.host_start) if starts is None else list(starts)
        for i, (row, s, n, dest) in enumerate(zip(rows, other.host_start, other.host_length, starts)):
            if dest < 0 or dest + n > self.capacity:
                raise ValueError(f"load_rows: row {row} would leave the cache's {self.capacity} columns")
            self.kv[:, :, row, :, dest:dest + n].copy_(other.kv[:, :, i, :, s:s + n])  # [L, 2, H_kv, n, D]
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)  # [b]
        self._start = self._start.index_copy(0, index, torch.tensor(starts, dtype=torch.int64, device=self.k.device))
        self._length = self._length.index_copy(0, index, other.length)
        for row, dest, n in zip(rows, starts, other.host_length):
            self.host_start[row], self.host_length[row] = dest, n

    def select_rows(self, index: list[int]) -> "KVCache":
        """A new cache (same capacity and layout) whose row i is a copy of row index[i]: its cached columns
        only, one slice copy per row (the n choices of one prompt, prefilled once)."""
        L, two, _, H, C, D = self.kv.shape
        kv = torch.zeros(L, two, len(index), H, C, D, dtype=self.kv.dtype, device=self.kv.device)  # [L, 2, b, H_kv, C, D]
        for i, j in enumerate(index):
            s, n = self.host_start[j], self.host_length[j]
            kv[:, :, i, :, s:s + n].copy_(self.kv[:, :, j, :, s:s + n])  # [L, 2, H_kv, n, D]
        rows = torch.tensor(index, dtype=torch.int64, device=self.kv.device)  # [b]
        cache = KVCache(kv, self._start.index_select(0, rows), self._length.index_select(0, rows), self.layout,
                        [self.host_start[j] for j in index], [self.host_length[j] for j in index])
        cache.backend = self.backend
        return cache

    def grow(self, capacity: int) -> None:
        """Give every row `capacity` columns (the cached columns keep their places; the new ones are zero)."""
        if capacity > self.capacity:
            self._restore(self.reserved_rows, capacity)

    def gather_rows(self, rows: list[int], buffer: "KVCache", offsets: list[int], width: int) -> "KVCache":
        """Rows `rows` of this (ragged) cache copied into the first len(rows) rows of `buffer`, row i's
        logical token t at column offsets[i] + t: a left-padded cache over the buffer's storage. One slice
        copy per row (index_select on these strided views takes a slow path on the CPU)."""
        g = len(rows)
        kv = buffer.kv[:, :, :g, :, :width]  # [L, 2, g, H_kv, width, D] view
        lengths = [self.host_length[r] for r in rows]
        for i, (row, n, o) in enumerate(zip(rows, lengths, offsets)):
            kv[:, :, i, :, o:o + n].copy_(self.kv[:, :, row, :, :n])  # [L, 2, H_kv, n, D]
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)  # [g]
        cache = KVCache(kv, torch.tensor(offsets, dtype=torch.int64, device=self.k.device),
                        self._length.index_select(0, index), LEFT_PADDED, offsets, lengths)
        cache.backend = self.backend
        cache.owner = buffer.owner if buffer.owner is not None else buffer  # its graphs are the buffer's
        return cache

    def scatter_rows(self, rows: list[int], batch: "KVCache", firsts: list[int]) -> None:
        """The inverse of `gather_rows` after a step: copy each batch row i's logical columns
        firsts[i]..length back into row rows[i] (start = 0), and its length."""
        for i, (row, first, n) in enumerate(zip(rows, firsts, batch.host_length)):
            src = batch.host_start[i] + first
            self.kv[:, :, row, :, first:n].copy_(batch.kv[:, :, i, :, src:src + n - first])  # [L, 2, H_kv, n', D]
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)  # [g]
        self._length.index_copy_(0, index, batch.length)
        for row, n in zip(rows, batch.host_length):
            self.host_length[row] = n
