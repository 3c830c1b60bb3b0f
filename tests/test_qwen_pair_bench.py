"""bench/qwen_pair.py's pure parts, with no model and no server: which prompts each category and cell gets, the
request sent to llama-server and the reading of its answer, the counters and speed-ups, the summary tables from
recorded numbers, and bad flags refused in one line naming the flag."""
import json
import os
import stat
from types import SimpleNamespace

import pytest

from bench import qwen_pair as qp


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture
def specbench(tmp_path):
    """A SpecBench-like file: 'writing' 5 questions, 'qa' 3, 'math' 1 (file order interleaved)."""
    rows = []
    for i in range(5):
        rows.append({"question_id": f"w{i}", "category": "writing", "turns": [f"write {i}", "second turn"]})
        if i < 3:
            rows.append({"question_id": f"q{i}", "category": "qa", "turns": [f"ask {i}"]})
    rows.append({"question_id": "m0", "category": "math", "turns": ["sum 0"]})
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path, specbench):
    """The flags a parse needs where the Qwen pair and llama-server are not here: stand-in files."""
    target, draft, server = tmp_path / "t.gguf", tmp_path / "d.gguf", tmp_path / "llama-server"
    for f in (target, draft, server):
        f.write_bytes(b"")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    return ["--target", str(target), "--draft", str(draft), "--specbench", specbench, "--llama-server", str(server)]


# ------------------------------------------------------------------------------------------------ prompts
def test_specbench_prompts_per_category_are_evenly_spaced_first_turns(specbench):
    prompts = qp.read_specbench(specbench, None, 2)
    assert [(p.category, p.text) for p in prompts] == [
        ("writing", "write 0"), ("writing", "write 2"), ("qa", "ask 0"), ("qa", "ask 1"), ("math", "sum 0")]
    assert prompts[0].source == "specbench:w0"
    assert qp.read_specbench(specbench, None, 2) == prompts  # deterministic
    assert [p.text for p in qp.read_specbench(specbench, ["qa", "code"], 1)] == ["ask 0"]
    assert qp.read_specbench(specbench, None, 0) == []
    with pytest.raises(ValueError, match="--categories: poetry not in"):
        qp.read_specbench(specbench, ["poetry"], 1)


def test_the_pool_is_round_robin_over_categories(specbench):
    pool = qp.build_pool(qp.read_specbench(specbench, None, 2) + qp.code_prompts(3))
    assert [p.category for p in pool] == ["writing", "qa", "math", "code", "writing", "qa", "code", "code"]
    assert [p.source for p in pool if p.category == "code"] == ["code:0", "code:1", "code:2"]
    assert len(qp.CODE_PROMPTS) == 10 and len(set(qp.CODE_PROMPTS)) == 10


def test_cells_pick_their_prompts(specbench):
    pool = qp.build_pool(qp.read_specbench(specbench, None, 2) + qp.code_prompts(3))  # 8 prompts, code at 3, 6, 7
    cells = qp.plan_cells(pool, [1, 4], [64, 256], [1], cell_prompts=6, long_prompts=2)
    by = {(c.batch_size, c.max_tokens): c for c in cells}
    assert set(by) == {(1, 64), (1, 256), (4, 64)}  # longer lengths only at --long-batch-sizes
    assert by[1, 64].prompts == list(range(8))  # batch 1, shortest: every prompt (the per-category table)
    assert by[4, 64].prompts == list(range(8))  # 6 rounded up to a multiple of 4
    assert [len(b) for b in by[4, 64].batches] == [4, 4]
    assert by[1, 256].prompts == [3, 6]  # code prompts first
    long4 = qp.plan_cells(pool, [4], [64, 256], [4], cell_prompts=1, long_prompts=5)
    assert long4[0].prompts == [0, 1, 2, 3] and long4[1].prompts == [3, 6, 7, 0, 1, 2, 4, 5]
    small = qp.plan_cells(pool[:3], [8], [64], [], cell_prompts=8, long_prompts=1)
    assert small[0].prompts == [0, 1, 2, 0, 1, 2, 0, 1]  # a pool shorter than the batch cycles


def test_chat_ids_reuse_what_specdec_run_chat_applies():
    seen = []

    def apply_chat_template(messages):
        seen.append(messages)
        return "<user>" + messages[0]["content"]

    tokenizer = SimpleNamespace(apply_chat_template=apply_chat_template,
                                encode=lambda text, add_special_tokens=True: [len(text), int(add_special_tokens)])
    assert qp.chat_ids(tokenizer, ["hi", "hello"]) == [[8, 0], [11, 0]]  # rendered, no special tokens added
    assert seen == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello"}]]


# ------------------------------------------------------------------------------------------------ llama.cpp
def test_the_request_body_sent_to_llama_server():
    body = qp.completion_body([151644, 8948, 198], 64)
    assert body == {"prompt": [151644, 8948, 198], "n_predict": 64, "ignore_eos": True, "cache_prompt": False,
                    "temperature": 0.0, "top_k": 1, "samplers": ["top_k", "temperature"], "return_tokens": True,
                    "stream": False}
    json.dumps(body)  # plain JSON: ints, not numpy or torch scalars


def test_server_commands_per_mode():
    def cmd(engine, extra=()):
        return qp.server_command("/bin/llama-server", engine, "T.gguf", "D.gguf", 2, 4, 2048, 5555, list(extra))

    ar = cmd("llama-ar")
    assert ar[:3] == ["/bin/llama-server", "-m", "T.gguf"]
    for flag, value in (("-t", "2"), ("-tb", "2"), ("-c", "2048"), ("-np", "4"), ("--host", "127.0.0.1"),
                        ("--port", "5555")):
        assert ar[ar.index(flag) + 1] == value
    assert "--no-webui" in ar and "--spec-type" not in ar and "-md" not in ar
    draft = cmd("llama-draft:8", ["--foo", "1"])
    assert draft[draft.index("--spec-type") + 1] == "draft-simple" and draft[draft.index("-md") + 1] == "D.gguf"
    assert draft[draft.index("--spec-draft-n-max") + 1] == "8" and draft[-2:] == ["--foo", "1"]
    ngram = cmd("llama-ngram")
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-mod" and "-md" not in ngram
    with pytest.raises(ValueError):
        cmd("ours")


def test_parsing_llama_server_timings():
    answer = {"content": "x", "tokens": [1, 2, 3, 4], "tokens_predicted": 4,
              "timings": {"prompt_n": 55, "prompt_ms": 400.0, "predicted_n": 4, "predicted_ms": 200.0,
                          "predicted_per_second": 20.0, "draft_n": 6, "draft_n_accepted": 2}}
    parsed = qp.parse_completion(answer)
    assert parsed == {"prompt_n": 55, "prompt_ms": 400.0, "predicted_n": 4, "predicted_ms": 200.0,
                      "predicted_per_second": 20.0, "draft_n": 6, "draft_n_accepted": 2, "tokens": [1, 2, 3, 4]}
    plain = qp.parse_completion({"tokens": [5, 6], "timings": {"prompt_n": 3, "predicted_n": 2}})
    assert plain["draft_n"] == 0 and plain["draft_n_accepted"] == 0 and plain["predicted_ms"] is None
    assert qp.parse_completion({"tokens_predicted": 7})["predicted_n"] == 7  # no timings: what it says it made
    # a decode step gains 1 + its accepted drafts; the first token comes from the prefill
    counts = qp.llama_counts([parsed, {**parsed, "draft_n": 0, "draft_n_accepted": 0}])
    assert counts == {"proposed": 6, "accepted": 2, "decode_tokens": 6, "row_steps": 4, "steps": None,
                      "draft_s": None}


def test_server_env_keeps_or_drops_the_benchmarks_spin(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert qp.server_env(2)["GOMP_SPINCOUNT"] == "10000" and qp.server_env(2)["OMP_NUM_THREADS"] == "2"
    assert "GOMP_SPINCOUNT" not in qp.server_env(2, default_spin=True)
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")  # the caller's own: kept
    assert qp.server_env(2, default_spin=True)["GOMP_SPINCOUNT"] == "123"


# ------------------------------------------------------------------------------------------------ summary
def record(engine, rnd, batch, seconds, tokens=64, B=1, N=64, prompts=None, counts=None, ids=None, stats=None):
    return {"engine": engine, "batch_size": B, "max_tokens": N, "round": rnd, "batch": batch,
            "prompts": prompts if prompts is not None else [batch], "seconds": seconds, "new_tokens": tokens,
            "tokens": ids if ids is not None else [[batch] * (tokens // B)] * B,
            "counts": counts or dict(proposed=0, accepted=0, decode_tokens=tokens - B, row_steps=tokens - B,
                                     steps=tokens - 1, draft_s=None),
            "stats": stats or {}}


def recorded():
    """Two rounds, two batch-1 prompts (categories a, b); llama AR 1 s a prompt, our AR 0.8 s, ours 0.5 s (round 1:
    0.4 s) with 40 of 50 drafts accepted over 20 row steps; draft-simple 1.25 s; transformers on prompt 0 only,
    2 s; at batch 4 only llama AR (4 s) and ours (2 s)."""
    out = []
    spec = dict(proposed=50, accepted=40, decode_tokens=63, row_steps=21, steps=21, draft_s=0.1)
    metrics = {"k_histogram": {"0": 1, "4": 20}}
    for rnd in (0, 1):
        for b in (0, 1):
            out.append(record("llama-ar", rnd, b, 1.0))
            out.append(record("ours-ar", rnd, b, 0.8))
            out.append(record("ours", rnd, b, 0.5 if rnd == 0 else 0.4, counts=spec,
                              stats={"metrics": metrics, "k_option": "auto"}))
            out.append(record("llama-draft:3", rnd, b, 1.25,
                              counts=qp.llama_counts([{"predicted_n": 64, "draft_n": 30, "draft_n_accepted": 27}]),
                              ids=[[9] * 64]))
        out.append(record("hf-assisted", rnd, 0, 2.0, counts=dict(proposed=40, accepted=32, decode_tokens=64,
                                                                  row_steps=32, steps=32, draft_s=0.64)))
        out.append(record("llama-ar", rnd, 0, 4.0, tokens=256, B=4, prompts=[0, 1, 0, 1]))
        out.append(record("ours", rnd, 0, 2.0, tokens=256, B=4, prompts=[0, 1, 0, 1]))
    return out


ENGINES = ["ours", "ours-ar", "llama-ar", "llama-draft:3", "hf-assisted"]
POOL = [{"category": "a"}, {"category": "b"}]


def test_summary_rows_from_recorded_numbers():
    rows = qp.summarise(recorded(), ENGINES)
    by = {(r["engine"], r["batch_size"]): r for r in rows}
    assert [(r["engine"], r["batch_size"]) for r in rows] == [
        ("ours", 1), ("ours-ar", 1), ("llama-ar", 1), ("llama-draft:3", 1), ("hf-assisted", 1), ("ours", 4),
        ("llama-ar", 4)]
    ours = by["ours", 1]
    assert ours["tokens_per_s_rounds"] == pytest.approx([128.0, 160.0])
    assert ours["tokens_per_s"]["median"] == pytest.approx(144.0)
    assert ours["x_llama_ar_rounds"] == pytest.approx([2.0, 2.5])  # per round, the same prompts
    assert ours["x_our_ar_rounds"] == pytest.approx([1.6, 2.0])
    assert ours["acceptance"] == pytest.approx(0.8) and ours["tokens_per_step"] == pytest.approx(3.0)
    assert ours["draft_ms_per_step"] == pytest.approx(100 / 21)
    assert ours["k_histogram"] == {"0": 4, "4": 80} and ours["k_option"] == "auto"
    assert ours["same_as_our_ar"] == {"same": 4, "of": 4} and ours["prompts"] == 2
    assert by["llama-ar", 1]["x_llama_ar"]["median"] == pytest.approx(1.0)
    assert by["llama-ar", 1]["acceptance"] is None and by["llama-ar", 1]["tokens_per_step"] == pytest.approx(1.0)
    draft = by["llama-draft:3", 1]
    assert draft["acceptance"] == pytest.approx(0.9) and draft["tokens_per_step"] == pytest.approx(63 / 36)
    assert draft["same_as_our_ar"] == {"same": 0, "of": 4} and draft["draft_ms_per_step"] is None
    # transformers ran prompt 0 alone: its speed-ups are over prompt 0 of the same rounds
    hf = by["hf-assisted", 1]
    assert hf["prompts"] == 1 and hf["x_llama_ar"]["median"] == pytest.approx(0.5)
    assert hf["tokens_per_step"] == pytest.approx(2.0) and hf["draft_ms_per_step"] == pytest.approx(20.0)
    # batch 4: no our AR there, so no "x our AR"
    assert by["ours", 4]["x_llama_ar"]["median"] == pytest.approx(2.0) and by["ours", 4]["x_our_ar"] is None


def test_a_speed_up_needs_the_reference_on_every_batch():
    mine = [record("ours", 0, 0, 1.0), record("ours", 0, 1, 1.0)]
    assert qp.per_round_ratio(mine, [record("llama-ar", 0, 0, 2.0)]) is None
    assert qp.per_round_ratio(mine, [record("llama-ar", 0, 0, 2.0), record("llama-ar", 0, 1, 2.0)]) == [2.0]


def test_category_rows_and_tables():
    records = recorded()
    cats = qp.category_rows(records, POOL, ENGINES)
    assert [c["category"] for c in cats] == ["a", "b"]
    a = cats[0]
    assert set(a["engines"]) == {"ours", "ours-ar", "llama-ar", "llama-draft:3", "hf-assisted"}
    assert a["engines"]["ours"]["median"] == pytest.approx(144.0)
    assert a["ours_x_our_ar"]["median"] == pytest.approx(1.8)
    assert a["best_llama_spec"] == "llama-draft:3" and a["ours_x_best_llama_spec"]["median"] == pytest.approx(2.8125)
    assert "hf-assisted" not in cats[1]["engines"]

    rows = qp.summarise(records, ENGINES)
    table = qp.summary_table(rows)
    assert table.splitlines()[0].startswith("| B | new tokens | engine | prompts | tokens/s median (min–max) | "
                                            "× llama.cpp AR | × our AR | acceptance | tokens/step |")
    assert ("| 1 | 64 | specdec default pair | 2 | 144.0 (128.0–160.0) | 2.25 (2.00–2.50) | 1.80 (1.60–2.00) "
            "| 80% | 3.00 |") in table
    never = qp.summary_table([{**rows[0], "engine": "llama-ngram", "acceptance": None}])
    assert "| no drafts |" in never  # a speculative engine that never drafted; AR rows keep "–"
    assert ("| 1 | 64 | llama.cpp AR | 2 | 64.0 (64.0–64.0) | 1.00 (1.00–1.00) | 0.80 (0.80–0.80) | – "
            "| 1.00 |") in table
    assert "auto (mean 3.8, 5% k=0)" in table and "| n-max 3 |" in table and "transformers defaults" in table
    lines = qp.headlines(rows)
    assert lines[0].startswith("B = 1, 64 new tokens: specdec default pair 144.0 tok/s = 2.25× llama.cpp AR, 2.81× "
                               "llama.cpp's fastest speculative mode (llama.cpp draft-simple n-max 3), 1.80× our AR")
    assert "draft-simple best at n-max 3" in lines[0]
    result = {"meta": {"target": "/x/t.gguf", "draft": "/x/d.gguf", "command": "python -m bench.qwen_pair",
                       "machine": {"torch": "2", "python": "3", "cpu": "cpu", "cpu_count": 2, "threads": 2, "git": "g",
                                   "date": "d", "loadavg": [1.0, 1.0, 1.0]},
                       "threads": 2, "rounds": 2, "engines": ENGINES, "llama_server_version": "v",
                       "eos_before_end": {"1x64": {"early": 1, "of": 4}}},
              "summary": rows, "categories": cats, "failures": ["llama-ngram (B=8) did not start: boom"]}
    md = qp.render(result)
    assert table in md and "| category | prompts | specdec default pair |" in md
    assert "B = 1, 64 tokens: 1/4" in md and "- llama-ngram (B=8) did not start: boom" in md


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    cats = qp.category_rows(recorded(), POOL, ENGINES)
    path = qp.plot(cats, ENGINES, str(tmp_path / "cats.png"))
    assert os.path.getsize(path) > 0


# ------------------------------------------------------------------------------------------------ flags
def test_quick_sets_its_defaults_and_explicit_flags_win(files, tmp_path):
    bench = tmp_path / "quick.jsonl"  # the categories --quick asks for
    bench.write_text("".join(json.dumps({"category": c, "turns": ["q"]}) + "\n"
                             for c in ("coding", "math_reasoning", "qa", "writing")))
    files[files.index("--specbench") + 1] = str(bench)
    args = qp.parse_args(["--quick", *files])
    assert args.batch_sizes == [1, 4] and args.max_tokens == [64] and args.rounds == 2
    assert args.categories == ["coding", "math_reasoning", "qa", "writing", "code"]
    assert args.engine_names == ["ours", "ours-ar", "ours-suffix", "llama-ar", "llama-draft:3", "llama-draft:8",
                                 "llama-ngram", "hf-assisted"]
    args = qp.parse_args(["--quick", "--rounds", "5", "--categories", "qa", "--engines", "ours,llama-draft",
                          "--draft-n-max", "16", *files])
    assert args.rounds == 5 and args.engine_names == ["ours", "llama-draft:16"]
    assert qp.parse_args(["--long-batch-sizes", "all", *files]).long_sizes == [1, 4, 8]


@pytest.mark.parametrize("flags, named", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--engines", "ours,vllm"], "--engines: 'ours,vllm': unknown vllm"),
    (["--batch-sizes", "0"], "--batch-sizes: '0'"),
    (["--long-batch-sizes", "one"], "--long-batch-sizes 'one'"),
    (["--categories", "poetry"], "--categories: poetry not in"),
    (["--code-prompts", "11"], "--code-prompts must be at most 10"),
    (["--llama-args", "'unclosed"], "--llama-args"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
])
def test_bad_flags_are_one_line_naming_the_flag(files, capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        qp.parse_args(files + flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench.qwen_pair: error: ") and named in err


def test_missing_files_name_their_flag(files, tmp_path, capsys):
    for flag, hint in (("--target", "bench.fetch_qwen"), ("--llama-server", "not an executable")):
        argv = list(files)
        argv[argv.index(flag) + 1] = str(tmp_path / "missing")
        with pytest.raises(SystemExit):
            qp.parse_args(argv)
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag in err and hint in err
    # without llama.cpp engines the server is not needed
    argv = list(files)
    argv[argv.index("--llama-server") + 1] = str(tmp_path / "missing")
    assert qp.parse_args(argv + ["--engines", "ours,ours-ar"]).engine_names == ["ours", "ours-ar"]


# ------------------------------------------------------------------------------------------------ the rounds
class FakeEngine:
    """An engine that only logs its calls (and raises at a chosen call)."""

    stateful = False

    def __init__(self, name, calls, fail_at=None):
        self.name, self.calls, self.fail_at, self.closed = name, calls, fail_at, False

    def warm_up(self, batch_ids, max_tokens):
        self.calls.append(("warm", self.name, max_tokens))

    def reset_round(self):
        self.calls.append(("reset", self.name))

    def measure(self, batch_ids, max_tokens):
        self.calls.append(("measure", self.name, len(batch_ids)))
        if self.fail_at is not None and sum(c[:2] == ("measure", self.name) for c in self.calls) == self.fail_at:
            raise RuntimeError("boom")
        tokens = [[1] * max_tokens for _ in batch_ids]
        return {"seconds": 1.0, "tokens": tokens, "new_tokens": max_tokens * len(batch_ids),
                "counts": dict(proposed=0, accepted=0, decode_tokens=0, row_steps=0, steps=None, draft_s=None),
                "stats": {}}

    def close(self):
        self.closed = True


def test_rounds_rotate_the_engines_reset_them_and_drop_a_failing_one(capsys):
    pool = [qp.Prompt("a", "x", "s:0", [1, 2]), qp.Prompt("b", "y", "s:1", [3]), qp.Prompt("c", "z", "s:2", [4])]
    cell = qp.Cell(1, 8, [0, 1, 2])
    args = SimpleNamespace(engine_names=["ours", "llama-ar", "hf-assisted"], max_tokens=[8], hf_prompts=1, rounds=2)
    result = {"measurements": [], "failures": []}
    runner = qp.Runner(args, pool, [cell], "/nonexistent", result)
    calls = []
    engines = {"ours": FakeEngine("ours", calls), "llama-ar": FakeEngine("llama-ar", calls, fail_at=5),
               "hf-assisted": FakeEngine("hf-assisted", calls)}
    failing = engines["llama-ar"]
    runner.run_cell(cell, engines)

    assert [c for c in calls if c[0] == "warm"] == [("warm", e, 8) for e in ("ours", "llama-ar", "hf-assisted")]
    measured = [c[1] for c in calls if c[0] == "measure"]
    # batch j of round r starts with engine r + j (transformers only on the first --hf-prompts batches); llama-ar
    # fails at its 5th call, the second batch of round 1, and is dropped: the others go on
    assert measured == ["ours", "llama-ar", "hf-assisted",  # round 0
                        "llama-ar", "ours",
                        "ours", "llama-ar",
                        "llama-ar", "hf-assisted", "ours",  # round 1
                        "ours", "llama-ar",
                        "ours"]
    assert [c for c in calls if c[0] == "reset"] == [("reset", e) for e in ("ours", "llama-ar", "hf-assisted")] + [
        ("reset", e) for e in ("ours", "llama-ar", "hf-assisted")]
    assert "llama-ar" not in engines and failing.closed
    assert result["failures"] == ["llama-ar (B=1, N=8): RuntimeError: boom"]
    assert "Traceback" in capsys.readouterr().err  # the exception's traceback, then the run goes on
    recs = result["measurements"]
    assert {(r["engine"], r["round"]) for r in recs if r["engine"] == "hf-assisted"} == {("hf-assisted", 0),
                                                                                       ("hf-assisted", 1)}
    assert sorted(r["batch"] for r in recs if r["engine"] == "ours") == [0, 0, 1, 1, 2, 2]
    assert all(r["categories"] == [pool[r["prompts"][0]].category] for r in recs)
    # the summary leaves llama-ar's round cut short out of its figures
    rows = {r["engine"]: r for r in qp.summarise(recs, args.engine_names)}
    assert rows["llama-ar"]["rounds"] == 1 and rows["ours"]["rounds"] == 2
