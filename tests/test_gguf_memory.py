"""Loading a GGUF at the size of its file (issue 58): `QuantRows` packs each chunk of decomposed rows into its part's
final tiles as it arrives (no decomposed copy of a weight is kept, no second copy is made at the end), bit for bit
what packing the whole weight at once gives, whatever the chunking and the order; and on the real model, the peak
resident memory while loading stays within 1.3x the file and the loaded model within 1.2x."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from block_models import raw_blocks
from specdec.models.ggml_blocks import decompose, pack
from specdec.models.quant import QuantizationError, QuantRows

K = 256


def rows_of(dec, first, last):
    return type(dec)(*(None if x is None else x[first:last] for x in dec))


def assert_packed_equal(got, want):
    assert (got.qtype, got.n, got.k) == (want.qtype, want.n, want.k)
    for field in ("codes", "da", "db", "sa", "sb"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, field
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), field


# runs of (block type, rows): part boundaries off the 16-row tiles, two runs of one type joined into one part
LAYOUT = [("Q4_K", 37), ("Q4_K", 20), ("Q6_K", 33), ("Q8_0", 16), ("Q4_1", 45)]


@pytest.fixture(scope="module")
def layout():
    rng = np.random.default_rng(0)
    runs, first = [], 0
    for qtype, n in LAYOUT:
        runs.append((first, n, qtype, decompose(raw_blocks(rng, qtype, n, K, 0.05), qtype)))
        first += n
    return runs


def expected_parts(runs):
    """(first row, Packed) per part: consecutive runs of one type joined, each packed whole."""
    parts = []
    for first, n, qtype, dec in runs:
        if parts and parts[-1][1] == qtype:
            parts[-1][2].append(dec)
        else:
            parts.append((first, qtype, [dec]))
    return [(first, pack(type(decs[0])(*(None if f[0] is None else torch.cat(f) for f in zip(*decs))), qtype))
            for first, qtype, decs in parts]


@pytest.mark.parametrize("chunk", [1, 5, 16, 23, 200])
@pytest.mark.parametrize("order", ["in order", "reversed", "shuffled"])
def test_streamed_tiles_equal_packing_the_whole_weight(layout, chunk, order):
    n = sum(r[1] for r in layout)
    rows = QuantRows("gguf", (n, K), "w", types=[(first, m, qtype) for first, m, qtype, _ in layout])
    pieces = [(first + a, qtype, rows_of(dec, a, min(m, a + chunk)))
              for first, m, qtype, dec in layout for a in range(0, m, chunk)]
    if order == "reversed":
        pieces.reverse()
    elif order == "shuffled":
        pieces = [pieces[i] for i in np.random.default_rng(1).permutation(len(pieces))]
    for first, qtype, dec in pieces:
        assert not rows.complete
        rows.add_blocks(first, dec, qtype)
    assert rows.complete
    layer = rows.module()
    want = expected_parts(layout)
    assert [row for row, _ in layer.parts] == [row for row, _ in want]
    for (_, got), (_, w) in zip(layer.parts, want):
        assert_packed_equal(got, w)


def test_rows_that_wait_for_their_tile_are_copies(layout):
    """A chunk ending inside a tile leaves only its last rows waiting, not a view that keeps the whole chunk."""
    first, n, qtype, dec = layout[0]
    rows = QuantRows("gguf", (n, K), "w", types=[(0, n, qtype)])
    rows.add_blocks(0, rows_of(dec, 0, 21), qtype)  # tile 0 packed, rows 16..20 wait
    waiting = rows.waiting[0][1]
    assert [row for row, _ in waiting] == [16]
    assert waiting[0][1].u.shape[0] == 5 and waiting[0][1].u.untyped_storage().nbytes() == 5 * K


def test_incomplete_or_misplaced_rows_are_refused(layout):
    first, n, qtype, dec = layout[2]  # Q6_K, 33 rows
    rows = QuantRows("gguf", (n, K), "model.gguf: tensor 'x'", types=[(0, n, qtype)])
    rows.add_blocks(0, rows_of(dec, 0, 20), qtype)
    with pytest.raises(QuantizationError, match="tensor 'x': 20 of 33 rows written"):
        rows.module()
    with pytest.raises(ValueError, match="do not fit the parts"):
        rows.add_blocks(20, rows_of(dec, 20, 33), "Q4_K")  # not the type this part was declared with
    with pytest.raises(ValueError, match="do not fit the parts"):
        rows.add_blocks(30, rows_of(dec, 20, 33), qtype)  # past the last row
    with pytest.raises(ValueError, match="cover 30 of 33 rows"):
        QuantRows("gguf", (n, K), "w", types=[(0, 30, qtype)])


def test_float_rows_quantized_on_the_cpu_stream_too():
    """`add_float` (a float tensor quantized to Q4_1 / Q8_0 at load): the default layout, one part."""
    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    rows = QuantRows("int4", (50, 64), "w")
    for a in range(0, 50, 7):
        rows.add_float(a, w[a:a + 7])
    whole = QuantRows("int4", (50, 64), "w")
    whole.add_float(0, w)
    (_, got), = rows.module().parts
    (_, want), = whole.module().parts
    assert_packed_equal(got, want)


MEASURE = """
import json, resource, sys, torch
import torch._dynamo  # noqa: F401  (as bench/loader_memory.py: load_state_dict's imports are not the model's)
from specdec.models import load_model
torch.ones(1).sum()

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024

base, base_rss = status("VmHWM"), status("VmRSS")
model = load_model(sys.argv[1])
print(json.dumps({"peak": status("VmHWM") - base, "loaded": status("VmRSS") - base_rss}))
"""


def test_the_real_model_loads_within_its_file_size():
    """SmolLM2-135M Q4_1 (94 MiB) as stored, in a fresh process: peak growth <= 1.3x the file while loading,
    <= 1.2x once loaded (measured 1.17x and 1.15x; the loader before streaming the tiles peaked at 2.4x)."""
    from real_model import real_gguf

    path = real_gguf()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", MEASURE, path], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    mib = json.loads(out.stdout.strip().splitlines()[-1])
    file_mib = os.path.getsize(path) / 2**20
    assert mib["peak"] <= 1.3 * file_mib and mib["loaded"] <= 1.2 * file_mib, (mib, file_mib)
