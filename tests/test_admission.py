"""Admission into a running EQSPEC batch copies the newcomer's row, not the batch: the bytes written outside
the forwards (bench/admission.py counts every tensor write) stay below one row's cache, whatever the
running rows' lengths."""
from bench.admission import measure


def test_eqspec_admission_copies_no_other_row():
    short, long = (measure(rows=6, length=n, prompt=4, threads=1) for n in (48, 192))
    for r in (short, long):  # the batch ends at one column with the newcomer in, the finished row out (asserted there)
        one_row = r["batch_cache_bytes"] / r["rows"]
        assert r["bytes_written"] < one_row / 4, r
    assert long["bytes_written"] == short["bytes_written"]  # independent of the other rows' cache sizes
