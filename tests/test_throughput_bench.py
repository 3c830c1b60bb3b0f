"""bench/throughput.py on the tiny pair: METHOD:K variants and auto k in one sweep, the outputs it promises,
and --replot merging a sweep run in two parts (small and large batch sizes) into one table and plot."""
import json
import os

from bench import throughput

import pytest

pytestmark = pytest.mark.slow  # not in the fast lane (pytest.ini)


def run_part(tmp_path, pair_dir, batch_sizes: str, name: str) -> str:
    out = tmp_path / name
    throughput.main(["--pair", "tiny", "--pair-dir", str(pair_dir), "--methods", "ar,ragged:auto,ragged:2",
                     "--batch-sizes", batch_sizes, "--num-prompts", "2", "--max-tokens", "6", "--threads", "1",
                     "--cost-repeats", "2", "--no-plots", "--out", str(out)])
    (jsonl,) = [f for f in os.listdir(out) if f.endswith(".jsonl")]
    return str(out / jsonl)


def test_variants_and_merged_replot(tmp_path, capsys):
    pair_dir = tmp_path / "pair"
    small, large = run_part(tmp_path, pair_dir, "1", "small"), run_part(tmp_path, pair_dir, "2", "large")
    rows = [json.loads(line) for line in open(small)]
    by = {r["method"]: r for r in rows}
    assert set(by) == {"ar", "ragged:auto", "ragged:2"}
    assert by["ragged:2"]["k"] == 2 and by["ragged:auto"]["k"] == "auto"
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)
    assert sum(int(n) for n in by["ragged:2"]["k_histogram"].values()) == by["ragged:2"]["steps"]
    capsys.readouterr()

    merged = tmp_path / "merged"
    throughput.main(["--replot", f"{small},{large}", "--out", str(merged)])
    table = capsys.readouterr().out
    cells = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ragged:2")]
    assert [b.strip() for _, b in cells] == ["1", "2"]  # both parts, in batch-size order
    assert (merged / "throughput-random.png").stat().st_size > 0
