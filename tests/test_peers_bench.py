"""bench/peers.py: its --quick run (tiny pair, a few tokens) writes the promised outputs with the promised
structure, and without transformers it prints one line and exits 2."""
import json
import sys

import pytest

from bench import peers

pytestmark = pytest.mark.slow  # not in the fast lane (pytest.ini)


def test_quick_run_outputs(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    peers.main(["--quick", "--threads", "1", "--out", str(out)])  # the tiny pair: built once, cached
    printed = capsys.readouterr().out

    lines = [json.loads(line) for line in (out / "peers.jsonl").read_text().splitlines()]
    meta, rows = lines[0], lines[1:]
    assert meta["type"] == "meta" and all(r["type"] == "row" for r in rows)
    for key in ("command", "git", "torch", "transformers", "threads", "loadavg_start", "hf_assisted_default"):
        assert key in meta, key
    assert meta["threads"] == 1 and "--quick" in meta["command"]
    (config,) = meta["configs"]
    assert (config["pair"], config["dtype"], config["max_tokens"], config["num_prompts"]) == ("tiny", "float32", 6, 2)
    assert len(config["target_sha256"]) == 12 and len(config["loadavg_before"]) == 3

    # every method at every batch size it supports; assisted generation only at batch 1
    cells = {(r["method"], r["batch_size"]) for r in rows}
    methods = peers.QUICK["methods"].split(",")
    expected = {(m, b) for m in methods for b in (1, 2) if not (m.startswith("hf-assisted") and b != 1)}
    assert cells == expected
    for r in rows:
        tps = r["tokens_per_s"]
        assert tps["min"] <= tps["median"] <= tps["max"] and tps["min"] > 0
        assert len(r["tokens_per_s_runs"]) == 1
        assert 0.0 <= r["exact_match_vs_hf_b1"] <= 1.0
        assert r["speedup_vs_hf_ar"]["median"] > 0
    by = {(r["method"], r["batch_size"]): r for r in rows}
    assert by[("hf-ar", 1)]["speedup_vs_hf_ar"]["median"] == pytest.approx(1.0)
    # float32 greedy: transformers at batch 1 is the reference; it and specdec's AR reproduce it exactly
    assert by[("hf-ar", 1)]["exact_match_vs_hf_b1"] == 1.0
    assert by[("ar", 1)]["exact_match_vs_hf_b1"] == 1.0
    assert by[("eqspec:auto", 1)]["k"] == "auto" and "k_histogram" in by[("eqspec:auto", 1)]

    md = (out / "peers.md").read_text()
    assert md.strip() in printed
    assert "| B | method |" in md and "exact vs HF@1" in md
    assert (out / "peers-tiny.png").stat().st_size > 0

    again = tmp_path / "replot"  # --replot re-renders the same report from the JSONL alone
    peers.main(["--replot", str(out / "peers.jsonl"), "--out", str(again), "--no-plots"])
    assert (again / "peers.md").read_text() == md.split("\n![")[0]


def test_missing_transformers_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        peers.main(["--quick", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == peers.MISSING_TRANSFORMERS + "\n" and captured.out == ""
    assert not (tmp_path / "out").exists()


def test_bad_method_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        peers.parse_args(["--methods", "ar,beam:3"])
    assert exit_info.value.code == 2
    assert "--methods 'beam:3'" in capsys.readouterr().err


def test_variant_labels():
    assert peers.parse_variant("ragged") == peers.Variant("ragged:auto", "specdec", "ragged", "auto")
    assert peers.parse_variant("eqspec:5+compile").compile
    assert peers.parse_variant("hf-assisted:default").k == "default"
    assert not peers.parse_variant("hf-assisted:5").runs_at(8)
    values = peers.per_config("16,synthetic=8,synthetic/bfloat16=4", "--num-prompts", ["default", "synthetic"],
                              ["float32", "bfloat16"])
    assert values == {("default", "float32"): 16, ("default", "bfloat16"): 16, ("synthetic", "float32"): 8,
                      ("synthetic", "bfloat16"): 4}
    with pytest.raises(ValueError, match="no value for the synthetic pair in float32"):
        peers.per_config("default=16", "--num-prompts", ["default", "synthetic"], ["float32"])
    with pytest.raises(ValueError, match="unknown key 'big'"):
        peers.per_config("big=3", "--max-tokens", ["default"], ["float32"])
