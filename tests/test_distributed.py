"""Scale-out on Ray (specdec.distributed, `python -m specdec.run --ray`), on one local Ray instance with
2 CPUs shared by the module; two Ray jobs in all (each pays ~20 s of replica start-up here).

`--ray --replicas 2` gives the single-process run's output, greedy and seeded sampling (float64 tiny pair
with a word-level tokenizer, so batch composition cannot flip near-ties); the sampled job also loses a
replica to SIGKILL and has a block raise once, and still answers every prompt once with the same samples;
a prompt too long for the context becomes an `error` line; `--ray` without Ray installed is one line
naming the extra; prompt files stream (distributed.plan_chunks, ray_replica.read_chunk) exactly as
`read_prompts` reads them.
"""
import json
import logging
import sys

import pytest

from checkpoints import make_pair, write_wordlevel_tokenizer
from faults import Fault, faulty_replica
from specdec import distributed, ray_replica
from specdec.prompts import read_prompts
from specdec.run import build_parser, main

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # not in the fast lane (pytest.ini)

NUM_PROMPTS = 64
DECODE = ["--method", "ragged", "--batch-size", "4", "-k", "3", "--max-tokens", "16", "--dtype", "float64",
          "--no-progress", "--samples", "0"]
SAMPLED = ["--temperature", "0.8", "--top-k", "20", "--seed", "3"]


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
             logging_level=logging.ERROR)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """A float64 llama pair with a word-level tokenizer, and 64 prompts of 1..9 words."""
    root = tmp_path_factory.mktemp("distributed")
    target, draft = make_pair("llama", root)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(128)]
    for d in (target, draft):
        write_wordlevel_tokenizer(d, words)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 128}" for j in range(i % 9 + 1))})
                               + "\n" for i in range(NUM_PROMPTS)))
    return root, ["--target", target, "--draft", draft, "--prompts", str(prompts)]


def run_cli(capsys, args: list[str], output) -> tuple[list[dict], str]:
    code = main([*args, "--output", str(output)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return [json.loads(line) for line in output.read_text().splitlines()], captured.out


def same_outputs(records: list[dict], reference: list[dict]) -> None:
    assert [r["index"] for r in records] == [r["index"] for r in reference]
    for r, ref in zip(records, reference):
        assert (r["token_ids"], r["text"], r["finish_reason"]) == \
            (ref["token_ids"], ref["text"], ref["finish_reason"]), r["index"]


@pytest.fixture(scope="module")
def single_process(workload):
    """The single-process CLI's records, greedy and sampled (computed once for the module)."""
    root, base = workload
    out = {}
    for name, extra in (("greedy", []), ("sampled", SAMPLED)):
        path = root / f"single-{name}.jsonl"
        assert main([*base, *DECODE, *extra, "--output", str(path)]) == 0
        out[name] = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(out["greedy"]) == NUM_PROMPTS
    assert sum(a["token_ids"] != b["token_ids"] for a, b in zip(out["greedy"], out["sampled"])) > NUM_PROMPTS // 2
    return out


def test_greedy_equals_the_single_process_run_and_a_bad_request_is_an_error_line(
        ray_local, workload, single_process, capsys):
    """`--ray --replicas 2`, greedy, over the 64 prompts plus a 65th too long for the context."""
    root, base = workload
    path = root / "with-bad.jsonl"
    path.write_text((root / "prompts.jsonl").read_text() + json.dumps({"prompt": " ".join(["w5"] * 600)}) + "\n")
    base = [*base[:-1], str(path)]  # --prompts with-bad.jsonl
    records, stdout = run_cli(capsys, [*base, *DECODE, "--ray", "--replicas", "2"], root / "ray-greedy.jsonl")
    same_outputs(records[:NUM_PROMPTS], single_process["greedy"])
    bad = records[NUM_PROMPTS]
    assert set(bad) == {"index", "prompt", "error"} and bad["index"] == NUM_PROMPTS
    assert f"prompt {NUM_PROMPTS} has 600 tokens" in bad["error"] and "context is 512" in bad["error"]
    assert "| method | batch | k | tokens/s | acceptance |" in stdout and "| ragged | 4 |" in stdout
    assert f"{NUM_PROMPTS + 1} requests (1 with an error)" in stdout and "on 2 replica(s)" in stdout


def test_sampled_equals_the_single_process_run_through_a_killed_replica_and_a_raising_block(
        ray_local, workload, single_process, capsys, monkeypatch, tmp_path):
    """`--ray --replicas 2`, seeded sampling, in blocks of 16 prompts. The replica that decoded prompts
    16..31 is SIGKILLed before returning them, and the block of prompts 32..47 raises once: Ray retries both
    blocks, every prompt is answered once, in order, with the samples of the single-process run (a retried
    request starts again from its own seed)."""
    root, base = workload
    killed, raised = tmp_path / "killed", tmp_path / "raised"
    monkeypatch.setattr(distributed, "Replica", faulty_replica(Fault("kill", 20, str(killed)),
                                                               Fault("raise", 40, str(raised))))
    records, stdout = run_cli(capsys, [*base, *DECODE, *SAMPLED, "--ray", "--replicas", "2"],
                              root / "ray-sampled.jsonl")
    assert killed.exists() and raised.exists()  # both drills fired (once each: the markers guard them)
    same_outputs(records, single_process["sampled"])  # indices 0..63, each once, in order
    # the blocks' metrics were summed once each: a retried block is not counted twice
    tokens = sum(len(r["token_ids"]) for r in records)
    assert f"{NUM_PROMPTS} requests (0 with an error), {tokens} tokens" in stdout


def test_ray_missing_is_one_line_naming_the_extra(workload, capsys, monkeypatch, tmp_path):
    _, base = workload
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    output = tmp_path / "out.jsonl"
    assert main([*base, *DECODE, "--ray", "--output", str(output)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install -e ".[ray]"' in err[0] and err[0].startswith("specdec.run: error: --ray")
    assert not output.exists()
    assert main([*base, *DECODE, "--replicas", "2"]) == 2
    assert "--replicas needs --ray" in capsys.readouterr().err
    help_text = build_parser().format_help()
    assert all(flag in help_text for flag in ("--ray ", "--ray-address ADDR", "--replicas REPLICAS"))


def test_prompt_files_stream_as_read_prompts_reads_them(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_bytes("# comment\nfirst\r\n\nsecond\\nline\n  \nthird é\n#x\nfourth\nfifth".encode("utf-8"))
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n\n{"turns": ["b", "ignored"]}\n{"prompt": "c\\nd"}\n{"prompt": "e"}\n')
    for path in (txt, jsonl):
        expected = read_prompts(str(path))
        for block_size in (1, 2, 3, 10):
            for limit in (None, 3):
                chunks, total = distributed.plan_chunks(["inline"], str(path), limit, block_size)
                rows = [r for c in chunks for r in ray_replica.read_chunk({"chunk": json.dumps(c)})]
                want = (["inline"] + expected)[:limit]
                assert total == len(want) and [r["prompt"] for r in rows] == want
                assert [r["index"] for r in rows] == list(range(total))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"turns": [{"x": 1}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: 'turns'"):
        distributed.plan_chunks([], str(bad), None, 4)


def test_a_replicas_user_error_surfaces_as_itself_in_one_line():
    """A CheckpointError raised in a replica reaches the driver wrapped by Ray (and with Ray Data's retry note
    appended); `unwrap_error` returns the original, one line, for run.py to print. A bug stays as it is."""
    exceptions = pytest.importorskip("ray.exceptions")
    from specdec.models import CheckpointError

    cause = CheckpointError("draft and target vocabulary sizes differ" + distributed.RAY_RETRY_NOTE + " after 1/1")
    wrapped = exceptions.RayTaskError("submit", "remote traceback", cause).as_instanceof_cause()
    found = distributed.unwrap_error(wrapped)
    assert found is cause and str(found) == "draft and target vocabulary sizes differ"
    bug = exceptions.RayTaskError("submit", "remote traceback", KeyError("x")).as_instanceof_cause()
    assert distributed.unwrap_error(bug) is bug
