"""The CUDA-graph runner's bookkeeping (models/graphs.py) behind a CPU stand-in of torch.cuda's graph API
(tests/graph_standin.py: it records the ops of a capture, replays them on the same static tensors, and raises
where a real graph would read freed memory): lifetime, re-keying, padding rows, table reuse, the width
attended, what auto k times, and the memory the admission check counts. Issue 50: one test per defect."""
import random

import pytest
import torch

from graph_standin import FreedMemoryRead, StandInCapture
from specdec import LLM, SamplingParams
from specdec import memory
from specdec.autok import forward_variant
from specdec.memory import HEADROOM, MemoryBudgetError, cache_bytes, check_cache_memory
from specdec.models import load_model
from specdec.models.numerics import set_batch_invariant
from specdec.options import positions_needed
from specdec.timing import time_forward


@pytest.fixture
def standin():
    return StandInCapture()


@pytest.fixture
def target(llama_pair):
    return load_model(llama_pair[0], dtype="float64")


def eager_forward(model, ids, cache, **kw):
    """The model's eager forward, whatever its runner."""
    runner, model.graph_runner = model.graph_runner, None
    try:
        return model.forward(ids, cache, **kw)
    finally:
        model.graph_runner = runner


def owned_shapes(standin):
    """The shapes of every tensor the live graphs allocated (their pools' outputs)."""
    return [tuple(rec[1].shape) for g in standin.live() for op in g.recording.ops for rec in op[3]
            if rec is not None and rec[1] is not None]


def static_shapes(standin):
    """The shapes of the tensors the live graphs read from outside (static inputs, storage views, tables)."""
    return [spec[2] for g in standin.live() for spec in g.recording.external.values()]


def test_graphs_die_with_their_caches_and_stay_bounded_over_100_admissions(llama_pair, standin):
    """Defect: graphs were never released (keyed by a storage address, one set per storage for good)."""
    model = load_model(llama_pair[0], dtype="float64")
    model.use_graphs(capture=standin)
    llm = LLM(model, method="ar", batch_size=8, dtype="float64")
    engine = llm.engine(stream_text=False)
    rng = random.Random(0)
    for turn in range(100):  # the engine goes idle after each turn: every turn's batch is a new storage
        for j in range(rng.randint(1, 8)):
            engine.add_request([5 + j, 6, 7 + turn % 5], SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    assert standin.captures >= 50 and standin.replays >= 50
    assert len(standin.live()) <= 4  # the last batch's graphs (one per bucket at most), nothing older
    assert len(model.graph_runner.live_steps()) <= model.graph_runner.max_graphs


def test_a_replay_after_the_tables_regrow_reads_the_live_tables(target, standin):
    """Defect: a graph captured the RoPE tables of its time; a longer cache regrew (and freed) them."""
    target.use_graphs(capture=standin)
    graphed, eager = target.new_cache(2, 12), target.new_cache(2, 12)
    ids = torch.tensor([[5, 6], [7, 8]])
    target.forward(ids, graphed)
    eager_forward(target, ids, eager)
    for t in range(4):
        step = torch.tensor([[9 + t], [10 + t]])
        torch.testing.assert_close(target.forward(step, graphed), eager_forward(target, step, eager), rtol=0,
                                   atol=1e-12)
    assert standin.replays >= 1
    target.forward(torch.tensor([[5, 6, 7]]), target.new_cache(1, 400))  # the tables regrow to 400+ positions
    step = torch.tensor([[20], [21]])
    out = target.forward(step, graphed)  # a replay (re-captured against the live tables)
    torch.testing.assert_close(out, eager_forward(target, step, eager), rtol=0, atol=1e-12)
    live = target._rope_heads[1]  # cos [N + 1, D] of the tables now
    assert live.shape[0] > 400 and any(shape == tuple(live.shape) for shape in static_shapes(standin))


def test_a_batch_of_five_replays_the_bucket_eight_graph(target, standin):
    """Defect: a batch of 3, 5, 6 or 7 rows ran eager (the storage had no rows for the bucket's padding)."""
    target.use_graphs(capture=standin)
    graphed, eager = target.new_cache(5, 16), target.new_cache(5, 16)
    ids = torch.tensor([[5, 6], [7, 8], [9, 10], [11, 12], [13, 14]])
    target.forward(ids, graphed)
    eager_forward(target, ids, eager)
    for t in range(4):
        step = torch.arange(5)[:, None] + 20 + t
        out = target.forward(step, graphed)
        assert out.shape[0] == 5
        torch.testing.assert_close(out, eager_forward(target, step, eager), rtol=0, atol=1e-12)
    assert standin.replays >= 1 and (8, 1) in static_shapes(standin)  # the bucket-8 graph's ids
    assert graphed.host_length == eager.host_length == [6] * 5


def test_exspec_s_groups_replay_graphs(llama_pair, standin):
    """Defect: exspec always ran eager (its batch is a view of the step buffer)."""
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    models = [load_model(p, dtype="float64") for p in llama_pair]
    ar = LLM(models[0], method="ar", batch_size=1, dtype="float64")
    expected = [o.token_ids for o in ar.generate(prompt_token_ids=prompts, sampling_params=params)]
    for model in models:
        model.use_graphs(capture=standin)
    llm = LLM(*models, method="exspec", num_speculative_tokens=3, batch_size=4, dtype="float64")
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)] == expected
    assert standin.replays > 0


def test_the_graph_step_attends_over_the_width_in_use(target, standin):
    """Defect: the graph step attended over the whole capacity (a [Bb, T, C] mask), eager over the width."""
    C = 999  # no dimension of the model is 999
    target.use_graphs(capture=standin)
    cache = target.new_cache(2, C)
    target.forward(torch.tensor([[5, 6], [7, 8]]), cache)
    for t in range(4):
        target.forward(torch.tensor([[9 + t], [10 + t]]), cache)
    shapes = owned_shapes(standin)
    assert standin.replays >= 1 and shapes
    assert not [s for s in shapes if C in s]


def test_graphed_and_eager_logits_are_bitwise_equal_under_batch_invariance(target, standin):
    """Defect: a row's numbers depended on whether its step was graphed."""
    set_batch_invariant(target, True)
    target.use_graphs(capture=standin)
    graphed, eager = target.new_cache(3, 40), target.new_cache(3, 40)
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0]])
    for cache in (graphed, eager):
        eager_forward(target, prompts, cache, num_new=[4, 2, 1])  # rows of different lengths
    for t in range(5):
        for T in (1, 3):
            step = torch.arange(3 * T).view(3, T) + 30 + t
            assert torch.equal(target.forward(step, graphed), eager_forward(target, step, eager))
    assert standin.replays >= 2


def test_auto_k_times_the_replayed_step_and_keys_its_costs_on_graphs(target, standin):
    """Defect: calibration timed eager runs and a capture; the cost cache's key ignored graphs."""
    eager_variant = forward_variant(target)
    target.use_graphs(capture=standin)
    assert forward_variant(target) != eager_variant and "graphs" in forward_variant(target)
    replays = []
    real = standin.CUDAGraph

    def graph():
        g = real()
        replay = g.replay
        g.replay = lambda: replays.append(1) or replay()
        return g

    standin.CUDAGraph = graph
    forwards = []
    forward = target.forward
    target.forward = lambda *a, **kw: forwards.append(len(replays)) or forward(*a, **kw)
    time_forward(target, rows=2, new_tokens=1, context=4, repeats=3)
    # every timed forward (the last three) replayed a graph
    assert len(replays) >= 3 and forwards[-3:] == [len(replays) - 3, len(replays) - 2, len(replays) - 1]


def test_compile_no_longer_captures_graphs_of_its_own(target, llama_pair, monkeypatch):
    """Defect: two capture mechanisms (the runner and torch.compile's "reduce-overhead")."""
    with pytest.raises(ValueError, match="CUDA graphs"):
        target.compile_forward("reduce-overhead")
    llm = LLM(target, method="ar", dtype="float64")
    modes = []
    monkeypatch.setattr(target, "compile_forward", lambda mode=None: modes.append(mode), raising=False)
    llm.device = torch.device("cuda")  # what LLM._compile asks for on CUDA
    llm._compile()
    assert modes == [None]


def test_the_admission_check_counts_the_graphs(target, standin, monkeypatch):
    """Defect: check_cache_memory counted the caches, not the graphs they run."""
    need = cache_bytes(target, 8, 64)
    monkeypatch.setattr(memory, "available_bytes", lambda device: int(need / HEADROOM) + 1)
    check_cache_memory((target, None), 8, 64, "cpu", 8)  # the caches alone fit
    target.use_graphs(capture=standin)
    with pytest.raises(MemoryBudgetError, match="graphs"):
        check_cache_memory((target, None), 8, 64, "cpu", 8)


def test_the_admission_check_counts_the_prefix_cache_s_budget(target, monkeypatch):
    """Defect: the prefix cache's budget was checked once, and KV admission later against what was free then:
    as the tree fills, both claim the same bytes."""
    prompt, params = [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True)
    kv = cache_bytes(target, 1, positions_needed(len(prompt), params.max_tokens, 0))
    free = int(kv / (HEADROOM * 0.5))  # the request's KV is half of what may be used
    monkeypatch.setattr(memory, "available_bytes", lambda device: free)
    monkeypatch.setattr("specdec.llm.available_bytes", lambda device: free)
    llm = LLM(target, method="ar", dtype="float64", prefix_cache_gb=0.6 * HEADROOM * free / 2**30)
    engine = llm.engine()
    with pytest.raises(MemoryBudgetError):
        engine.add_request(prompt, params)


def test_without_the_stand_in_a_freed_input_is_never_read(target, standin):
    """The stand-in itself: a replay after a captured input was freed raises (what the runner must avoid)."""
    x = torch.ones(4, dtype=torch.float64)
    out = {}
    g = standin.CUDAGraph()
    with standin.graph(g):
        out["y"] = x * 2
    x.fill_(3)
    g.replay()
    assert out["y"].tolist() == [6.0] * 4
    del x
    with pytest.raises(FreedMemoryRead):
        g.replay()
