"""Copy a tensor's bytes from a safetensors file straight into a preallocated destination.

`safe_open(...).get_tensor` maps the file: every page a conversion or a copy reads stays resident in the
process (and counts in its RSS) for as long as any tensor of that file is alive. Reading with plain file
reads instead puts the bytes only where they are wanted: directly into the destination when the dtype is
already right and the destination is in CPU memory, else through one bounded staging buffer, a chunk at
a time, converted by `copy_` (which also moves to a GPU). The file must already have been validated by
`safe_open` (header, offsets within the file); this module only reads.
"""
from __future__ import annotations

import json

import torch

STAGING_BYTES = 16 << 20  # one chunk of a converted tensor in flight at a time


class ShardReader:
    """Raw reads from one safetensors file: `read_into(key, source_dtype, destination)`."""

    def __init__(self, file: str):
        self.file = file
        self.handle = open(file, "rb", buffering=0)
        header_len = int.from_bytes(self._read(0, 8), "little")
        header = json.loads(self._read(8, header_len))
        self.data_start = 8 + header_len
        self.offsets = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
        self._staging: torch.Tensor | None = None

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, offset: int, size: int) -> bytes:
        self.handle.seek(offset)
        data = self.handle.read(size)
        if len(data) != size:
            raise OSError(f"file ends after {offset + len(data)} bytes, expected at least {offset + size}")
        return data

    def _read_exact_into(self, offset: int, buffer) -> None:
        """Fill the writable byte buffer `buffer` (a memoryview) from `offset`; reads can come back short."""
        self.handle.seek(offset)
        done = 0
        while done < len(buffer):
            n = self.handle.readinto(buffer[done:])
            if not n:
                raise OSError(f"file ends after {offset + done} bytes, expected at least {offset + len(buffer)}")
            done += n

    def _staging_bytes(self, size: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < size:
            self._staging = torch.empty(size, dtype=torch.uint8)
        return self._staging[:size]

    def read_into(self, key: str, source_dtype: torch.dtype, destination: torch.Tensor) -> None:
        """Copy tensor `key` (stored as `source_dtype`) into the contiguous `destination` of the same number of
        elements, converting to its dtype and moving to its device."""
        begin, end = self.offsets[key]
        flat = destination.view(-1)  # contiguous: a view, never a copy
        itemsize = source_dtype.itemsize
        if flat.numel() * itemsize != end - begin:
            raise ValueError(f"{self.file}: {key!r} holds {end - begin} bytes, expected {flat.numel() * itemsize}")
        offset = self.data_start + begin
        if flat.dtype == source_dtype and flat.device.type == "cpu":
            if flat.numel():
                self._read_exact_into(offset, memoryview(flat.view(torch.uint8).numpy()))
            return
        per_chunk = max(1, STAGING_BYTES // itemsize)
        for first in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - first)
            staging = self._staging_bytes(count * itemsize)
            self._read_exact_into(offset + first * itemsize, memoryview(staging.numpy()))
            flat[first: first + count].copy_(staging.view(source_dtype))  # converts, and moves to the device
