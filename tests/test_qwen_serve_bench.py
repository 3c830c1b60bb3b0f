"""bench/qwen_serve.py's pure parts, with no model and no server: /metrics text read into acceptance, the k
histogram and the steps without drafts (the text our server's own metrics classes write), the request bodies and
server commands, the clients' concurrency, the rounds (each server started fresh, the order rotating, every server
closed, a failing one dropped), the summary tables from recorded numbers, and bad flags refused in one line."""
import json
import stat
import threading
import time
from types import SimpleNamespace

import pytest

from bench import qwen_pair as qp
from bench import qwen_serve as qs


# ------------------------------------------------------------------------------------------------ /metrics
def metrics_text(generated, proposed, accepted, steps, k_histogram, drafters=None, k_max=8) -> str:
    """What our server's GET /metrics answers for these engine counters (specdec/serve/metrics.py itself)."""
    pytest.importorskip("prometheus_client")
    from specdec.serve.metrics import ServerMetrics

    stats = {"running": 0, "waiting": 0, "generated_tokens": generated, "proposed_drafts": proposed,
             "accepted_drafts": accepted, "steps": steps,
             "acceptance_rate": accepted / proposed if proposed else 0.0, "k_histogram": dict(k_histogram),
             "drafts_by_drafter": drafters or {}, "prefill_chunks": 0, "prefix_cache": None}
    worker = SimpleNamespace(stats=lambda: stats)
    forward = {"forward": "native", "isa": "avx512-vnni", "reason": ""}
    return ServerMetrics(worker, k_max, forward).render().decode()


def test_metrics_text_gives_acceptance_k_and_steps_without_drafts():
    text = metrics_text(100, 40, 30, 20, {0: 5, 3: 10, 5: 5}, {"model": (30, 20), "suffix": (10, 10)})
    m = qs.parse_metrics(text)
    assert (m["generated"], m["proposed"], m["accepted"], m["steps"]) == (100, 40, 30, 20)
    assert m["acceptance_rate"] == pytest.approx(0.75)
    assert m["k_histogram"] == {0: 5, 3: 10, 5: 5}  # per k, from the cumulative buckets
    assert m["drafters"] == {"model": {"proposed": 30, "accepted": 20}, "suffix": {"proposed": 10, "accepted": 10}}
    assert m["forward"] == {"forward": "native", "isa": "avx512-vnni", "reason": ""}
    # an AR server: every step at k = 0, nothing proposed
    ar = qs.parse_metrics(metrics_text(50, 0, 0, 49, {0: 49}))
    assert ar["k_histogram"] == {0: 49} and ar["proposed"] == 0 and ar["drafters"] == {}


def test_a_metrics_delta_leaves_the_start_up_warm_up_out():
    before = qs.parse_metrics(metrics_text(40, 10, 2, 30, {0: 25, 2: 5}, {"model": (10, 2)}))
    after = qs.parse_metrics(metrics_text(140, 50, 32, 50, {0: 30, 2: 5, 4: 15}, {"model": (30, 12),
                                                                                  "suffix": (20, 20)}))
    d = qs.metrics_delta(before, after)
    assert (d["generated"], d["proposed"], d["accepted"], d["steps"]) == (100, 40, 30, 20)
    assert d["acceptance"] == pytest.approx(0.75)
    assert d["k_histogram"] == {0: 5, 4: 15}  # k = 2 did not move: left out
    assert d["drafters"] == {"model": {"proposed": 20, "accepted": 10}, "suffix": {"proposed": 20, "accepted": 20}}
    assert qs.metrics_delta(before, before)["acceptance"] is None  # nothing proposed: no acceptance

    answers = [{"tokens": [1] * 64}, {"tokens": [2] * 64}]
    assert qs.our_counts(d, answers, 1) == {"proposed": 40, "accepted": 30, "decode_tokens": 126, "row_steps": 20,
                                            "steps": 20, "draft_s": None}
    assert qs.our_counts(d, answers, 8)["row_steps"] is None  # rows a step: unknown with several clients
    stats = qs.our_stats("ours", d)
    assert stats["metrics"]["k_histogram"] == {"0": 5, "4": 15} and stats["k_option"] == "auto"
    assert qs.our_stats("ours-ar", d)["k_option"] is None


# ------------------------------------------------------------------------------------------------ requests
def test_the_request_body_sent_to_our_server():
    body = qs.completion_request("qwen", [151644, 8948, 198], 64)
    assert body == {"model": "qwen", "prompt": [151644, 8948, 198], "max_tokens": 64, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True, "stream": False}
    json.dumps(body)
    pytest.importorskip("pydantic")
    from specdec.serve.protocol import CompletionRequest

    CompletionRequest.model_validate(body)  # the server's own request model takes it (strict: no coercion)
    answer = {"choices": [{"text": "x", "token_ids": [5, 6, 7], "finish_reason": "length"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 3}}
    assert qs.parse_our_answer(answer) == {"tokens": [5, 6, 7], "finish_reason": "length", "completion_tokens": 3}


def test_server_commands():
    args = SimpleNamespace(target="/m/T.gguf", draft="/m/D.gguf", threads=2)
    ours = qs.our_command("ours", 5555, args, 8)
    assert ours[1:3] == ["-m", "specdec.serve"] and ours[ours.index("--port") + 1] == "5555"
    for flag, value in (("--target", "/m/T.gguf"), ("--draft", "/m/D.gguf"), ("--batch-size", "8"),
                        ("--threads", "2"), ("--host", "127.0.0.1")):
        assert ours[ours.index(flag) + 1] == value
    assert "--method" not in ours and "--profile" not in ours  # the pair with the server's defaults
    ar = qs.our_command("ours-ar", 5555, args, 2)
    assert ar[ar.index("--method") + 1] == "ar" and ar[ar.index("--batch-size") + 1] == "2"
    shown = qs.shown_command(ours)
    assert shown.startswith("python -m specdec.serve ") and "--port PORT" in shown


def test_clients_keep_at_most_their_count_in_flight_and_answers_keep_prompt_order():
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def ask(p):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.01)
        with lock:
            state["now"] -= 1
        return p * 10

    answers, seconds = qs.send_all(ask, list(range(7)), 3)
    assert answers == [0, 10, 20, 30, 40, 50, 60] and state["most"] == 3 and seconds > 0

    def failing(p):
        if p == 2:
            raise qp.EngineFailed("boom")
        return p

    with pytest.raises(qp.EngineFailed, match="boom"):
        qs.send_all(failing, [0, 1, 2, 3], 2)


# ------------------------------------------------------------------------------------------------ the plan
def test_phases_rounds_and_the_default_estimate():
    args = SimpleNamespace(one_names=["ours", "ours-ar"], many_names=["ours", "ours-ar", "llama-ar", "llama-draft:3"],
                           prompts=16, max_tokens=64, one_client_batch_size=8, clients=8, concurrent_prompts=16,
                           concurrent_max_tokens=128)
    one, many = qs.plan_phases(args, 23)
    assert (one.clients, one.batch_size, one.prompts, one.title) == (1, 8, list(range(16)), "one client")
    assert (many.clients, many.batch_size, many.max_tokens, many.title) == (8, 8, 128, "8 clients")
    assert qs.plan_phases(SimpleNamespace(**{**vars(args), "concurrent_prompts": 5}), 3)[1].prompts == [0, 1, 2, 0, 1]
    assert qs.estimate_s([one, many], 3) < 40 * 60  # the default run fits the 40 minutes (as guessed)
    assert [qs.rotated(["a", "b", "c"], r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"],
                                                                  ["c", "a", "b"], ["a", "b", "c"]]
    pool = [qp.Prompt("code", "x", "code:0", [1] * 700), qp.Prompt("qa", "y", "s:1", [1] * 40)]
    assert qs.llama_context(pool, qs.Phase(8, 128, [0, 1], ["llama-ar"], 8), 3) == 8 * 1024


def test_the_best_draft_n_max_of_a_qwen_pair_run():
    def row(n, B, tps, N=64):
        return {"engine": f"llama-draft:{n}", "batch_size": B, "max_tokens": N, "tokens_per_s": {"median": tps}}

    result = {"summary": [row(3, 1, 10.0), row(8, 1, 9.0), row(3, 8, 18.0), row(8, 8, 20.0), row(16, 8, 30.0, N=256),
                          {"engine": "llama-ar", "batch_size": 8, "max_tokens": 64, "tokens_per_s": {"median": 99.0}}]}
    assert qs.best_n_max(result, 8) == 8  # at batch 8, the shortest length
    assert qs.best_n_max(result, 2) == 3  # batch 1 is nearer 2 than 8
    assert qs.best_n_max({"summary": []}, 8) is None


# ------------------------------------------------------------------------------------------------ rounds
class FakeServer:
    """A server that answers from a script: `fail` = {name: 'start' or 'ask'}; our servers' /metrics count."""

    log: list = []
    fail: dict = {}

    def __init__(self, name, phase, args, context, log_path):
        self.name, self.phase, self.ours = name, phase, name.startswith("ours")
        self.command, self.start_s, self.closed = ["srv", name], 1.5, False
        self.m = {"generated": 10.0, "proposed": 0.0, "accepted": 0.0, "steps": 9.0, "acceptance_rate": 0.0,
                  "k_histogram": {0: 9.0}, "drafters": {}, "forward": {"forward": "native", "isa": "avx2"}}

    def start(self):
        FakeServer.log.append(("start", self.name, self.phase.clients))
        if FakeServer.fail.get(self.name) == "start":
            raise qp.EngineFailed(f"{self.name} did not start: boom")

    def ask(self, ids, max_tokens):
        if FakeServer.fail.get(self.name) == "ask":
            raise RuntimeError("broken answer")
        if self.ours:
            drafted = self.name == "ours"
            self.m = {**self.m, "generated": self.m["generated"] + max_tokens,
                      "proposed": self.m["proposed"] + 8 * drafted, "accepted": self.m["accepted"] + 6 * drafted,
                      "steps": self.m["steps"] + (2 if drafted else max_tokens - 1),
                      "k_histogram": {0: self.m["k_histogram"][0] + (0 if drafted else max_tokens - 1),
                                      **({4: self.m["k_histogram"].get(4, 0) + 2} if drafted else {})}}
        return {"tokens": [len(ids)] * max_tokens, "seconds": 0.5 if self.name == "ours" else 1.0,
                "finish_reason": "length", "predicted_n": max_tokens, "draft_n": 0, "draft_n_accepted": 0}

    def metrics(self):
        return {**self.m, "k_histogram": dict(self.m["k_histogram"]), "text": "# fake"} if self.ours else None

    def close(self):
        self.closed = True
        FakeServer.log.append(("close", self.name, self.phase.clients))


def test_rounds_start_every_server_fresh_rotate_them_and_close_each(monkeypatch, capsys):
    monkeypatch.setattr(qs, "Server", FakeServer)
    FakeServer.log, FakeServer.fail = [], {"llama-draft:3": "start", "ours-ar": "ask"}
    pool = [qp.Prompt("code", "x", "code:0", [1, 2]), qp.Prompt("qa", "y", "s:1", [3])]
    args = SimpleNamespace(rounds=2, n_max=3)
    one = qs.Phase(1, 4, [0, 1], ["ours", "ours-ar"], 8)
    many = qs.Phase(2, 4, [0, 1, 0, 1], ["ours", "llama-ar", "llama-draft:3"], 2)
    result = {"servers": {}, "measurements": [], "failures": []}
    runner = qs.Runner(args, pool, [one, many], "/nonexistent", result, [9])
    checkpoints = []
    runner.run(lambda: checkpoints.append(len(result["measurements"])))

    starts = [(n, c) for what, n, c in FakeServer.log if what == "start"]
    assert starts == [("ours", 1), ("ours-ar", 1), ("ours", 2), ("llama-ar", 2), ("llama-draft:3", 2),  # round 1
                      ("ours", 1), ("llama-ar", 2), ("ours", 2)]  # round 2: rotated; the failed ones dropped
    assert [x for x in FakeServer.log if x[0] == "close"] == [("close", n, c) for n, c in starts]  # each closed
    assert result["failures"] == ["ours-ar (one client, round 1): RuntimeError: broken answer",
                                  "llama-draft:3 (2 clients, round 1): EngineFailed: llama-draft:3 did not start: boom"]
    assert "Traceback" in capsys.readouterr().err  # an unexpected exception's traceback, then the run goes on
    assert len(checkpoints) == 8  # after every server run (not after the dropped ones)
    recs = result["measurements"]
    one_recs = [r for r in recs if r["batch_size"] == 1]
    assert [(r["round"], r["batch"], r["prompts"]) for r in one_recs] == [(0, 0, [0]), (0, 1, [1]), (1, 0, [0]),
                                                                          (1, 1, [1])]
    # one client: /metrics read around every request, the warm-up left out
    assert one_recs[0]["counts"] == {"proposed": 8, "accepted": 6, "decode_tokens": 3, "row_steps": 2, "steps": 2,
                                     "draft_s": None}
    assert one_recs[0]["stats"]["metrics"]["k_histogram"] == {"4": 2}
    many_recs = [r for r in recs if r["batch_size"] == 2]
    assert {(r["engine"], r["round"]) for r in many_recs} == {("ours", 0), ("llama-ar", 0), ("ours", 1),
                                                              ("llama-ar", 1)}
    ours2 = next(r for r in many_recs if r["engine"] == "ours")
    assert ours2["prompts"] == [0, 1, 0, 1] and ours2["new_tokens"] == 16 and ours2["counts"]["row_steps"] is None
    assert result["servers"]["ours@1"]["start_s"] == [1.5, 1.5]
    assert result["servers"]["ours@1"]["forward"] == {"forward": "native", "isa": "avx2"}


# ------------------------------------------------------------------------------------------------ summary
def rec(engine, clients, rnd, batch, seconds, prompts, tokens=64, counts=None, stats=None, ids=None,
        request_seconds=None):
    n = len(prompts)
    return {"engine": engine, "batch_size": clients, "max_tokens": tokens, "round": rnd, "batch": batch,
            "prompts": prompts, "categories": ["c"] * n, "seconds": seconds, "new_tokens": tokens * n,
            "tokens": ids or [[p] * tokens for p in prompts], "request_seconds": request_seconds or [seconds] * n,
            "counts": counts or dict(proposed=0, accepted=0, decode_tokens=(tokens - 1) * n, row_steps=None,
                                     steps=None, draft_s=None),
            "stats": stats or {}}


def recorded():
    """Two rounds. One client, two prompts: our AR 4 s a request, the pair 2 s (round 2: 2.5 s) with 48 of 60 drafts
    accepted over 15 steps, 3 of them without drafts. Two clients, four prompts: llama.cpp AR 10 s, draft-simple 16 s
    (acceptance 50%), our AR 8 s, the pair 12.5 s."""
    out = []
    spec = dict(proposed=60, accepted=48, decode_tokens=63, row_steps=15, steps=15, draft_s=None)
    spec_stats = {"metrics": {"k_histogram": {"0": 3, "5": 12}}, "k_option": "auto",
                  "drafters": {"model": {"proposed": 50, "accepted": 38}, "suffix": {"proposed": 10, "accepted": 10}}}
    ar_stats = {"metrics": {"k_histogram": {"0": 63}}, "k_option": None, "drafters": {}}
    ar_counts = dict(proposed=0, accepted=0, decode_tokens=63, row_steps=63, steps=63, draft_s=None)
    for rnd in (0, 1):
        for b in (0, 1):
            out.append(rec("ours-ar", 1, rnd, b, 4.0, [b], counts=ar_counts, stats=ar_stats))
            out.append(rec("ours", 1, rnd, b, 2.0 if rnd == 0 else 2.5, [b], counts=spec, stats=spec_stats))
        prompts = [0, 1, 2, 3]
        llama = qp.llama_counts([{"predicted_n": 64, "draft_n": 20, "draft_n_accepted": 10}] * 4)
        plain = qp.llama_counts([{"predicted_n": 64, "draft_n": 0, "draft_n_accepted": 0}] * 4)
        out.append(rec("llama-ar", 2, rnd, 0, 10.0, prompts, counts=plain))
        out.append(rec("llama-draft:3", 2, rnd, 0, 16.0, prompts, counts=llama))
        out.append(rec("ours-ar", 2, rnd, 0, 8.0, prompts, stats={"metrics": {"k_histogram": {"0": 200}},
                                                                 "k_option": None}))
        out.append(rec("ours", 2, rnd, 0, 12.5, prompts, counts=dict(proposed=100, accepted=40, decode_tokens=252,
                                                                     row_steps=None, steps=120, draft_s=None),
                       stats={"metrics": {"k_histogram": {"0": 100, "2": 20}}, "k_option": "auto"}))
    return out


PHASES = [qs.Phase(1, 64, [0, 1], ["ours", "ours-ar"], 8),
          qs.Phase(2, 64, [0, 1, 2, 3], ["ours", "ours-ar", "llama-ar", "llama-draft:3"], 2)]


def test_rows_tables_and_headlines_from_recorded_numbers():
    rows = qs.phase_rows(recorded(), PHASES)
    by = {(r["engine"], r["clients"]): r for r in rows}
    assert [(r["engine"], r["clients"]) for r in rows] == [("ours", 1), ("ours-ar", 1), ("ours", 2), ("ours-ar", 2),
                                                           ("llama-ar", 2), ("llama-draft:3", 2)]
    ours1 = by["ours", 1]
    assert ours1["tokens_per_s_rounds"] == pytest.approx([32.0, 25.6])
    assert ours1["x_our_ar_rounds"] == pytest.approx([2.0, 1.6]) and ours1["x_llama_ar"] is None
    assert ours1["acceptance"] == pytest.approx(0.8) and ours1["tokens_per_step"] == pytest.approx(63 / 15)
    assert ours1["steps"] == 60 and ours1["steps_without_drafts"] == 12  # 4 requests x (3 of 15)
    assert ours1["drafters"] == {"model": {"proposed": 200, "accepted": 152}, "suffix": {"proposed": 40,
                                                                                         "accepted": 40}}
    assert ours1["request_tokens_per_s"]["median"] == pytest.approx(28.8)  # 32, 32, 25.6, 25.6
    assert ours1["same_as_our_ar"] == {"same": 4, "of": 4}
    ours2 = by["ours", 2]
    assert ours2["tokens_per_s"]["median"] == pytest.approx(20.48)
    assert ours2["x_llama_ar"]["median"] == pytest.approx(0.8)
    assert ours2["x_our_ar"]["median"] == pytest.approx(0.64)
    assert ours2["tokens_per_step"] is None and ours2["request_tokens_per_s"] is None
    assert by["llama-draft:3", 2]["acceptance"] == pytest.approx(0.5)

    table = qs.serve_table(rows)
    assert table.splitlines()[0].startswith("| clients | new tokens | server | prompts | tokens/s median (min–max) |")
    assert ("| 1 | 64 | specdec default pair | 2 | 28.8 (25.6–32.0) | 28.8 (25.6–32.0) | 1.80 (1.60–2.00) | – | 80% "
            "| 4.20 | auto (mean 4.0, 20% k=0) | 12/60 (20%) | 4/4 |") in table
    assert ("| 2 | 64 | llama.cpp AR | 4 | 25.6 (25.6–25.6) | – | 0.80 (0.80–0.80) | 1.00 (1.00–1.00) | – | 1.00 | – "
            "| – |") in table
    assert "| 2 | 64 | llama.cpp draft-simple n-max 3 |" in table and "| n-max 3 |" in table

    lines = qs.headlines(rows)
    assert lines[0].startswith("one client, 64 new tokens: the pair server 28.8 tok/s = 1.80 (1.60–2.00)× the same "
                               "server with --method ar (bar ≥ 1.3×: met); drafted: acceptance 80% of 240 drafts")
    assert "steps without drafts 12/60 (20%)" in lines[0]
    assert lines[1].startswith("2 clients, 64 new tokens: the pair server 20.5 tok/s = 0.80 (0.80–0.80)× "
                               "llama-server -np 2 AR (bar ≥ 1×: not met), 0.64 (0.64–0.64)× our AR server")
    no_ar = qs.headlines(qs.phase_rows([r for r in recorded() if r["engine"] != "ours-ar"], PHASES))
    assert "our AR" not in no_ar[1] and "(bar ≥ 1×: not met); llama.cpp draft-simple" in no_ar[1]
    assert "our AR server 1.25 (1.25–1.25)× llama.cpp AR" in lines[1]
    assert "llama.cpp draft-simple n-max 3 16.0 tok/s (0.62× its AR, acceptance 50%)" in lines[1]

    drafting = qs.drafting_lines(rows)
    assert drafting[0] == ("specdec default pair, one client: 192/240 drafts accepted (by drafter, accepted/proposed: "
                           "model 152/200; suffix 40/40); k histogram (k: steps) {0: 12, 5: 48}; steps without "
                           "drafts 12/60 (20%)")

    one = [r for r in recorded() if r["batch_size"] == 1]
    pool = [{"category": "code"}, {"category": "qa"}]
    result = {"meta": {"target": "/x/t.gguf", "draft": "/x/d.gguf", "command": "python -m bench.qwen_serve",
                       "machine": {"torch": "2", "python": "3", "cpu": "AMD EPYC (AVX-512 VNNI)", "cpu_count": 2,
                                   "threads": 2, "git": "abc+dirty", "date": "d", "loadavg": [1.0, 1.0, 1.0]},
                       "threads": 2, "rounds": 2, "llama_server_version": "v",
                       "phases": [{**vars(p), "title": p.title} for p in PHASES]},
              "summary": rows, "categories": qp.category_rows(one, pool, ["ours", "ours-ar"]),
              "servers": {"ours@1": {"command": "python -m specdec.serve --target T", "start_s": [30.0, 31.5],
                                     "forward": {"forward": "native", "isa": "avx512-vnni"}}},
              "failures": ["llama-draft:3 (8 clients, round 1): EngineFailed: did not start"]}
    md = qs.render(result)
    assert "AMD EPYC (AVX-512 VNNI)" in md and "git abc+dirty" in md and "`python -m bench.qwen_serve`" in md
    assert "#### one client: 2 prompts, 64 new tokens each, requests one after another" in md
    assert "#### 2 clients: 4 prompts, 64 new tokens each, 2 requests in flight at a time" in md
    assert "| category | prompts | specdec default pair | specdec AR |" in md
    assert "- ours@1: `python -m specdec.serve --target T` — 30.0, 31.5 s; forward native (avx512-vnni)" in md
    assert "- llama-draft:3 (8 clients, round 1): EngineFailed: did not start" in md


# ------------------------------------------------------------------------------------------------ flags
@pytest.fixture
def files(tmp_path):
    target, draft, server, bench = (tmp_path / n for n in ("t.gguf", "d.gguf", "llama-server", "q.jsonl"))
    for f in (target, draft, server):
        f.write_bytes(b"")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    bench.write_text("".join(json.dumps({"category": c, "turns": ["q"]}) + "\n"
                             for c in ("coding", "math_reasoning", "qa", "writing")))
    return ["--target", str(target), "--draft", str(draft), "--specbench", str(bench), "--llama-server", str(server)]


def test_quick_and_the_server_lists(files, tmp_path):
    args = qs.parse_args(["--quick", *files])
    assert (args.rounds, args.prompts, args.concurrent_prompts, args.concurrent_max_tokens) == (2, 5, 8, 64)
    assert args.one_names == ["ours", "ours-ar"] and args.many_names == ["ours", "ours-ar", "llama-ar",
                                                                          "llama-draft:3"]
    args = qs.parse_args(["--quick", "--rounds", "4", "--draft-n-max", "8", "--concurrent-servers", "ours,llama-draft",
                          *files])
    assert args.rounds == 4 and args.many_names == ["ours", "llama-draft:8"]
    pair = tmp_path / "pair.json"
    pair.write_text(json.dumps({"summary": [{"engine": "llama-draft:16", "batch_size": 8, "max_tokens": 64,
                                             "tokens_per_s": {"median": 5.0}}]}))
    assert qs.parse_args(["--draft-n-max-from", str(pair), *files]).many_names[-1] == "llama-draft:16"


@pytest.mark.parametrize("flags, named", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--clients", "1"], "--clients must be >= 2"),
    (["--concurrent-servers", "ours,vllm"], "--concurrent-servers: 'ours,vllm': unknown vllm"),
    (["--categories", "poetry"], "--categories: poetry not in"),
    (["--draft-n-max", "0"], "--draft-n-max must be >= 1"),
    (["--draft-n-max-from", "/nonexistent.json"], "--draft-n-max-from /nonexistent.json"),
    (["--llama-args", "'unclosed"], "--llama-args"),
])
def test_bad_flags_are_one_line_naming_the_flag(files, capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        qs.parse_args(files + flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench.qwen_serve: error: ") and named in err


def test_llama_server_is_needed_only_for_its_servers(files, tmp_path, capsys):
    argv = list(files)
    argv[argv.index("--llama-server") + 1] = str(tmp_path / "missing")
    with pytest.raises(SystemExit):
        qs.parse_args(argv)
    assert "--llama-server" in capsys.readouterr().err
    assert qs.parse_args(argv + ["--concurrent-servers", "ours,ours-ar"]).many_names == ["ours", "ours-ar"]
