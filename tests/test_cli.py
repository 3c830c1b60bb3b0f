"""`python -m specdec.run` driven as a subprocess: the no-argument run, a JSONL run with --output,
--compare-ar at 100% in float64, and the error cases (one line on stderr, non-zero exit, no output file)."""
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import make_pair, write_wordlevel_tokenizer
from cli_helpers import jsonl_indexes, quick_cli, start_cli, wait_for_partial


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


@pytest.mark.slow
def test_no_arguments_runs_the_default_pair():
    result = cli()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "| method | batch | k | tokens/s | acceptance |" in out
    assert "| ar |" in out and "| eqspec |" in out
    assert "Check against AR decoding:" in out
    assert "--- request 0" in out
    assert "(the embedded pair is a toy: " in out  # issue 44: its repetitive samples are explained


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


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_drafters_without_a_model_from_the_command_line(pair, drafter):
    """--draft ngram|suffix (and their flags): exact against AR, the summary names the drafter."""
    target, _, root = pair
    prompts = root / f"repeats-{drafter}.txt"
    prompts.write_text("\n".join(" ".join(f"w{(i + j) % 9}" for j in range(30)) for i in range(5)) + "\n")
    extra = ("--ngram-min", "2", "--ngram-max", "3") if drafter == "ngram" else ("--suffix-store-tokens", "0")
    result = cli("--target", target, "--draft", drafter, *extra, "--prompts", str(prompts), "--method", "ragged",
                 "--batch-size", "2", "--max-tokens", "16", "--dtype", "float64", "--compare-ar",
                 "--check-invariants", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "Check against AR decoding: 5/5 exact-match (100.0%)" in result.stdout
    assert "| ragged |" in result.stdout and f"| {drafter} |" in result.stdout


def test_text_prompts_and_sampling(pair):
    target, draft, _ = pair
    result = cli("--target", target, "--draft", draft, "--prompt", "w1 w2", "--prompt", "w3", "--temperature", "0.8",
                 "--top-k", "20", "--seed", "3", "--max-tokens", "8", "--method", "exspec", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "| exspec |" in result.stdout


def test_the_summary_names_the_weights_format(pair):
    """A quantized run's summary says what its weights are, not `dtype float32` (a newcomer's report, issue 51)."""
    from types import SimpleNamespace

    from specdec.summary import weights_summary

    target, draft, _ = pair
    float_model = SimpleNamespace(target=SimpleNamespace(quantize=None))
    assert weights_summary(float_model, SimpleNamespace(dtype=None)) == "dtype float32"
    quantized = cli("--target", target, "--method", "ar", "--prompt", "w1 w2", "--max-tokens", "4", "--no-progress",
                    "--quantize", "int4")
    assert quantized.returncode == 0, quantized.stderr
    from specdec.kernels import qmm_cpu

    runs = f"native forward ({qmm_cpu.host_isa()})" if qmm_cpu.available() else "torch forward ("
    assert f"; weights Q4_1+Q8_0 (--quantize int4), activations float32, {runs}" in quantized.stdout, quantized.stdout
    off = cli("--target", target, "--method", "ar", "--prompt", "w1 w2", "--max-tokens", "4", "--no-progress",
              "--quantize", "int4", "--no-native-forward")
    assert "torch forward (turned off" in off.stdout, off.stdout


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
                 "--check-invariants", "--chat", "--chat-template", "--system"):
        assert flag in result.stdout
    assert "(default: None)" not in result.stdout and "(default: False)" not in result.stdout  # said in the text


def test_a_bad_integer_and_a_file_for_a_checkpoint_are_one_plain_line(tmp_path):
    """Not argparse's `invalid positive_int value`, nor 'checkpoint directory not found' for a file that exists;
    argparse's refusal and the program's own begin alike, with the program's name (issue 51: `specdec: error:`
    and `python -m specdec.run: error:` by path)."""
    result = cli("--batch-size", "two")
    assert result.returncode == 2 and "--batch-size: must be an integer >= 1, got 'two'" in result.stderr
    assert "positive_int" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("specdec.run: error: argument --batch-size"), result.stderr
    readme = tmp_path / "README.md"
    readme.write_text("# not a model\n")
    result = cli("--target", str(readme))
    assert result.returncode == 2 and "a file that is not a .gguf" in result.stderr, result.stderr
    assert result.stderr.startswith(f"specdec.run: error: --target {readme}: "), result.stderr


# --------------------------------------------------------------------------- issue 12: --output, signals, devices


def many_prompts(root, n: int) -> str:
    path = root / f"prompts{n}.txt"
    path.write_text("\n".join(" ".join(f"w{(i * 5 + j) % 128}" for j in range(1 + i % 7)) for i in range(n)) + "\n")
    return str(path)


def pair_args(pair, *more):
    target, draft, _ = pair
    return ["--target", target, "--draft", draft, "--method", "ragged", "--batch-size", "2", "-k", "2",
            "--no-progress", "--samples", "0", *more]


def test_output_through_a_symlink_with_the_umask(pair, tmp_path, capsys):
    """The link stays a link, its target gets the records in prompt order with the user's umask, no temporary
    is left, and the summary says which device "auto" chose. (In-process, like the next two: main() is the CLI.)"""
    import torch

    from specdec.run import main

    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    os.symlink(real, link)
    previous = os.umask(0o022)
    try:
        code = main(pair_args(pair, "--prompts", many_prompts(tmp_path, 5), "--max-tokens", "6", "--output", str(link)))
    finally:
        os.umask(previous)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert os.path.islink(link) and oct(os.stat(real).st_mode & 0o777) == oct(0o644)
    assert [json.loads(line)["index"] for line in real.read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path)) == ["link.jsonl", "prompts5.txt", "real.jsonl"]
    assert f"device {'cuda' if torch.cuda.is_available() else 'cpu'} (auto)" in out


def test_output_to_dev_stdout_streams_the_lines(pair, tmp_path, capfd):
    from specdec.run import main

    assert main(pair_args(pair, "--prompts", many_prompts(tmp_path, 4), "--max-tokens", "6",
                          "--output", "/dev/stdout")) == 0
    out, err = capfd.readouterr()
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(r["index"] for r in records) == [0, 1, 2, 3]
    assert "streamed 4 requests to /dev/stdout" in out


OUTPUT_CONTRACT = ("index", "prompt", "text", "token_ids", "prompt_token_ids", "finish_reason")
OUTPUT_VARYING = ("accepted_counts", "speculative_tokens", "latency_s", "time_to_first_token_s")


def test_output_tokens_are_reproducible_and_the_docs_say_what_varies(pair, tmp_path, capsys):
    """The same seeded command twice (auto k, sampling, float64) writes the same text and tokens; docs/api.md's
    `--output` and the --help say so, and name every other field of a line (k, acceptance, timings) as varying
    from run to run."""
    from specdec.run import build_parser, main

    runs = []
    for n in (1, 2):
        output = tmp_path / f"run{n}.jsonl"
        code = main(pair_args(pair, "--prompts", many_prompts(tmp_path, 6), "--max-tokens", "12", "-k", "auto",
                              "--temperature", "0.8", "--seed", "7", "--dtype", "float64", "--output", str(output)))
        assert code == 0, capsys.readouterr().err
        runs.append([json.loads(line) for line in output.read_text().splitlines()])
    assert set(runs[0][0]) == set(OUTPUT_CONTRACT + OUTPUT_VARYING)
    assert [[r[f] for f in OUTPUT_CONTRACT] for r in runs[0]] == [[r[f] for f in OUTPUT_CONTRACT] for r in runs[1]]
    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    section = " ".join(api[api.index("**`--output FILE.jsonl`**"):api.index("- A symlink is written through")].split())
    contract, varying = section.split("the contract")[0], section.split("vary between runs")[1]
    assert all(f"`{f}`" in contract for f in OUTPUT_CONTRACT) and all(f"`{f}`" in varying for f in OUTPUT_VARYING)
    assert "auto k" in varying
    help_text = " ".join(build_parser().format_help().split())
    assert "text and tokens are reproducible" in help_text and "timings vary from run to run" in help_text


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_output_to_dev_full_is_one_line_and_the_device_survives(pair, tmp_path, capsys):
    from specdec.run import main

    assert main(pair_args(pair, "--prompts", many_prompts(tmp_path, 4), "--max-tokens", "6",
                          "--output", "/dev/full")) == 2
    assert capsys.readouterr().err == "specdec.run: error: --output /dev/full: cannot write (No space left on device)\n"
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_disk_full_part_way_keeps_the_finished_requests(pair, tmp_path):
    """A file-size limit (what a full disk looks like to the writer) hit after a few requests: exit 2 with one
    line naming the kept partial file, which holds exactly the lines it says."""
    import resource

    output = tmp_path / "out.jsonl"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))  # noqa: E731
    result = quick_cli(*pair_args(pair, "--prompts", many_prompts(tmp_path, 20), "--max-tokens", "12",
                                  "--output", str(output)), preexec_fn=limit)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "--output" in line and "File too large" in line
    kept = line.rsplit(" are in ", 1)[1]
    count = int(line.split("; the ")[1].split(" request(s)")[0])
    assert os.path.dirname(kept) == str(tmp_path) and not output.exists()
    data = open(kept).read()
    records = [json.loads(x) for x in data.splitlines()]  # issue 26: whole lines only, exactly `count` of them
    assert data.endswith("\n") and count >= 1 and len(records) == count == len({r["index"] for r in records})


@pytest.mark.parametrize("signum,code,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_sigterm_and_ctrl_c_clean_up_with_one_line(pair, tmp_path, signum, code, word):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = out_dir / "out.jsonl"
    proc = start_cli(*pair_args(pair, "--prompts", many_prompts(tmp_path, 400), "--max-tokens", "32",
                                "--output", str(output)))
    wait_for_partial(proc, out_dir)  # requests are being streamed to the partial file
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"specdec.run: {word}")
    # issue 26: the requests finished before the signal are kept, as after an error: whole JSON lines only
    # in the hidden partial file, which the line names with its count, and the output itself is not created
    kept = os.listdir(out_dir)
    assert len(kept) == 1 and kept[0].startswith(".out.jsonl.") and kept[0].endswith(".partial")
    assert err.strip().rsplit(" are in ", 1)[1] == str(out_dir / kept[0]) and not output.exists()
    count = int(err.split("; the ")[1].split(" request(s)")[0])
    assert len(jsonl_indexes(out_dir / kept[0])) == count >= 1


def test_check_weights_flag(pair, tmp_path, capsys):
    """--check-weights passes a healthy pair (and says how long the scan took) and stops with one line naming
    the file and key when a weight is NaN. In-process: no model decoding happens in the failing case."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specdec.run import main

    target, draft, _ = pair
    assert main(["--target", target, "--draft", draft, "--prompt", "w1 w2", "--max-tokens", "2", "--check-weights",
                 "--no-progress", "--samples", "0", "--no-compare-ar"]) == 0
    assert "Weights checked finite (no NaN/inf) in " in capsys.readouterr().out
    broken = tmp_path / "draft"
    shutil.copytree(draft, broken)
    file = broken / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    assert main(["--target", target, "--draft", str(broken), "--prompt", "w1", "--check-weights", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert f"{file}: weight 'model.layers.0.mlp.up_proj.weight' has 1 non-finite value(s)" in err


# --------------------------------------------------------------------------- issue 44: a newcomer's first hour


def test_a_lookups_printed_speed_up_comes_from_prompts_it_has_not_seen_answered(pair, tmp_path, capsys):
    """--compare-ar with --draft suffix: the warm-up and the batch-B run answer the very prompts the batch-1 run
    then decodes, and the suffix store keeps those answers. Each timed run must draft as a fresh LLM would on
    the same prompts (fixed k, float64: its drafts, and so its counts, are a function of what it has seen)."""
    from specdec import LLM, SamplingParams
    from specdec.run import main

    target, _, _ = pair
    prompts = [" ".join(f"w{(i * 11 + j * j) % 128}" for j in range(3 + i)) for i in range(6)]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    metrics = tmp_path / "m.json"
    settings = dict(method="ragged", num_speculative_tokens=3, dtype="float64")
    assert main(["--target", target, "--draft", "suffix", "--prompts", str(path), "--method", "ragged", "-k", "3",
                 "--batch-size", "4", "--max-tokens", "24", "--dtype", "float64", "--compare-ar", "--metrics",
                 str(metrics), "--no-progress", "--samples", "0"]) == 0
    assert "Check against AR decoding: 6/6 exact-match" in capsys.readouterr().out
    ar1, spec1, ar4, spec4 = json.loads(metrics.read_text())
    assert (spec1["batch_size"], spec4["batch_size"]) == (1, 4) and spec1["num_requests"] == 6
    for row, batch in ((spec4, 4), (spec1, 1)):
        fresh = LLM(target, draft="suffix", batch_size=batch, **settings)
        m = fresh.generate(prompt_token_ids=fresh.encode(prompts),
                           sampling_params=SamplingParams(max_tokens=24)).metrics
        assert m.proposed_drafts > 0 and m.accepted_drafts > 0  # the test has drafts to count
        assert (row["proposed_drafts"], row["accepted_drafts"], row["steps"]) == \
            (m.proposed_drafts, m.accepted_drafts, m.steps), f"batch {batch}: drafted from answers it had seen"


@pytest.mark.parametrize("store", ["16384", "0"])
def test_prompts_that_repeat_are_said_to_draft_from_this_runs_answers(pair, capsys, store):
    """A prompt given twice is drafted from its first answer by the suffix store within the run (what a server
    would do): the summary says so, unless the store is off."""
    from specdec.run import main

    target, _, _ = pair
    assert main(["--target", target, "--draft", "suffix", "--suffix-store-tokens", store, "--prompt", "w1 w2",
                 "--prompt", "w3", "--prompt", "w1 w2", "--max-tokens", "4", "--no-compare-ar", "--no-progress",
                 "--samples", "0"]) == 0
    note = "(1 of the prompts repeats an earlier one: suffix drafts from the answers this run already gave"
    assert (note in capsys.readouterr().out) == (store != "0")


def test_one_prompt_is_decoded_at_batch_1_and_the_summary_counts_what_it_timed(pair, tmp_path, capsys, monkeypatch):
    """One request with the default --batch-size 8: the table says batch 1 (no second pair of rows repeating
    it) and the summary line "1 request"; auto k's calibration, which the progress bar sees, is named beside
    the decoding time; the realign share is a column only with --profile."""
    from specdec.run import main

    target, draft, _ = pair
    assert main(["--target", target, "--draft", draft, "--prompt", "w1 w2", "--max-tokens", "6", "--compare-ar",
                 "--no-progress", "--samples", "0"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ") and "method" not in line]
    assert [line.split(" | ")[:2] for line in table] == [["| ar", "1"], ["| eqspec", "1"]], out
    assert "realign share" not in out and "batch-1 rows" not in out and "\n1 request, 6 tokens in " in out
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached costs: the timed run calibrates
    metrics = tmp_path / "m.json"
    assert main(["--target", target, "--draft", draft, "--prompt", "w1 w2", "--prompt", "w3", "--max-tokens", "4",
                 "--profile", "--no-compare-ar", "--no-progress", "--samples", "0", "--metrics", str(metrics)]) == 0
    out = capsys.readouterr().out
    [m] = json.loads(metrics.read_text())
    assert m["calibration_s"] >= 0.01 and "| realign share |" in out
    assert f"\n2 requests, {m['generated_tokens']} tokens in {m['wall_time_s']:.2f} s; target forwards" in out, out
    # issue 58: one start-up figure (not a second one on the line above), then a line per finding
    lines = out.splitlines()
    [first] = [i for i, line in enumerate(lines) if line.startswith("start-up measurement: ")]
    assert lines[first].endswith(" s (not counted in tokens/s or latencies)") and out.count("start-up measurement") == 1
    seconds = float(lines[first].split()[2])
    # the timed run's calibration is in it (calibration_s also counts the engine's bookkeeping around it: a few ms)
    assert seconds >= 0.9 * m["calibration_s"] - 0.01, (seconds, m["calibration_s"])
    assert any(line.startswith("  auto-k costs at B=2, context <= ") for line in lines[first + 1:]), out  # which batch


def test_the_embedded_pair_says_it_is_a_toy_and_a_real_target_does_not(pair, capsys):
    from specdec.run import TOY_PAIR, main

    assert main(["--prompt", "def f(x):", "--max-tokens", "2", "--no-compare-ar", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.index(TOY_PAIR) < out.index("--- request 0")  # said before its samples
    target, draft, _ = pair
    assert main(["--target", target, "--draft", draft, "--prompt", "w1", "--max-tokens", "2", "--no-progress"]) == 0
    assert "toy" not in capsys.readouterr().out
