"""`python -m specdec.run` driven as a subprocess: the no-argument run, a JSONL run with --output,
--compare-ar at 100% in float64, and the error cases (one line on stderr, non-zero exit, no output file)."""
import json
import os
import subprocess
import sys

import pytest

from checkpoints import make_pair, write_wordlevel_tokenizer


def cli(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "specdec.run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target, draft = make_pair("llama", root)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(128)]
    for d in (target, draft):
        write_wordlevel_tokenizer(d, words)
    return target, draft, root


def test_no_arguments_runs_the_default_pair():
    result = cli()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "| method | batch | tokens/s | acceptance |" in out
    assert "| ar |" in out and "| eqspec |" in out
    assert "Check against AR decoding:" in out
    assert "--- request 0" in out


def test_jsonl_prompts_output_and_compare_ar(pair):
    target, draft, root = pair
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 128}" for j in range(i + 1))})
                                 for i in range(10)) + "\n" + json.dumps({"turns": ["w5 w6", "ignored"]}) + "\n")
    output = root / "out.jsonl"
    result = cli("--target", target, "--draft", draft, "--prompts", str(prompts), "--method", "ragged",
                 "--batch-size", "4", "-k", "3", "--max-tokens", "24", "--dtype", "float64", "--compare-ar",
                 "--check-invariants", "--output", str(output), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "Check against AR decoding: 11/11 exact-match (100.0%)" in result.stdout
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 11 and records[-1]["prompt"] == "w5 w6"
    for r in records:
        assert set(r) >= {"prompt", "text", "token_ids", "accepted_counts", "latency_s"}
        assert 0 < len(r["token_ids"]) <= 24


def test_text_prompts_and_sampling(pair):
    target, draft, _ = pair
    result = cli("--target", target, "--draft", draft, "--prompt", "w1 w2", "--prompt", "w3", "--temperature", "0.8",
                 "--top-k", "20", "--seed", "3", "--max-tokens", "8", "--method", "exspec", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "| exspec |" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--target", "/nonexistent/t", "--draft", "/nonexistent/d"], "--target /nonexistent/t: checkpoint directory not found"),
    (["--prompts", "/nonexistent/p.txt"], "/nonexistent/p.txt: prompt file not found"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
])
def test_errors_are_one_line(tmp_path, args, message):
    output = tmp_path / "out.jsonl"
    result = cli(*args, "--output", str(output), "--no-progress")
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not output.exists()


def test_bad_flag_values_and_mismatched_vocabularies(pair, tmp_path):
    target, draft, root = pair
    result = cli("--batch-size", "0")
    assert result.returncode == 2 and "--batch-size" in result.stderr
    bad = root / "bad.jsonl"
    bad.write_text('{"prompt": "w1"}\nnot json\n')
    result = cli("--target", target, "--draft", draft, "--prompts", str(bad))
    assert result.returncode == 2 and "bad.jsonl:2: not valid JSON" in result.stderr
    other = make_pair("llama", tmp_path, vocab_size=200)[1]
    output = tmp_path / "o.jsonl"
    result = cli("--target", target, "--draft", other, "--prompt", "w1", "--output", str(output))
    assert result.returncode == 2 and "error:" in result.stderr
    assert not output.exists()


def test_help_explains_every_flag():
    result = cli("--help")
    assert result.returncode == 0
    for flag in ("--target", "--draft", "--prompt ", "--prompts", "--method", "--batch-size", "-k", "--max-tokens",
                 "--temperature", "--top-k", "--top-p", "--seed", "--dtype", "--device", "--output", "--compare-ar",
                 "--check-invariants", "--chat"):
        assert flag in result.stdout
