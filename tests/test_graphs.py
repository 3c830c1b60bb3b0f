"""The CUDA-graph step (models/graphs.py) computed without capture on the CPU: the static-buffer path a graph
replays -- the bucket's padded rows, the plan computed on the device from start/length over a width bucket --
gives AR's tokens for every method, and the runner falls back to eager exactly where a graph cannot serve.
The runner's bookkeeping behind a capture stand-in: tests/test_graph_runner.py; the capture itself on a GPU:
test_the_real_capture_replays_the_eager_step below and bench/gpu_check.sh."""
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.models import load_model
from specdec.models.graphs import GraphRunner

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def models(llama_pair):
    target, draft = llama_pair
    return load_model(target, dtype="float64"), load_model(draft, dtype="float64")


def generate(target, draft, method, **kw):
    llm = LLM(target, draft if method != "ar" else None, method=method, num_speculative_tokens=3,
              batch_size=kw.pop("batch_size", 4), dtype="float64", **kw)
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS,
                                              sampling_params=SamplingParams(max_tokens=12, ignore_eos=True))]


@pytest.mark.parametrize("method", ["ar", "ragged", "eqspec", "exspec"])
def test_the_graph_step_gives_ar_s_tokens(models, method, monkeypatch):
    target, draft = models
    expected = generate(target, draft, "ar", batch_size=1)
    taken = []
    real = GraphRunner.takes
    monkeypatch.setattr(GraphRunner, "takes", lambda self, *a: taken.append(out := real(self, *a)) or out)
    for model in models:
        model.use_graphs(capture=False)
    try:
        assert generate(target, draft, method) == expected
    finally:
        for model in models:
            model.use_graphs(False)
    assert any(taken) and not all(taken)  # steps through the graph path (exspec's groups too); prefills eager


def test_the_runner_buckets_rows_and_steps_aside(models):
    target, _ = models
    runner = GraphRunner(target, capture=False)
    assert [runner.bucket(b) for b in (1, 2, 3, 5, 9, 32, 33)] == [1, 2, 4, 8, 16, 32, None]
    cache = target.new_cache(3, 16)
    ids = torch.tensor([[5, 6], [7, 8], [9, 10]])
    assert not runner.takes(ids, cache, [2, 1, 2])  # a padded prefill: eager
    assert not runner.takes(torch.zeros(3, 17, dtype=torch.int64), cache, None)  # overflow
    assert runner.takes(ids, cache, None) and cache.reserved_rows == 3
    eager_cache = target.new_cache(3, 16)
    out = runner.run(ids, cache, "all", None, None)  # [3, 2, V]: the storage gets the 4-row bucket's rows
    assert cache.reserved_rows == 4
    want = target.forward(ids, eager_cache)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert cache.host_length == [2, 2, 2] and torch.equal(cache.length, torch.tensor([2, 2, 2]))
    torch.testing.assert_close(cache.k[:, :3, :, :2], eager_cache.k[:, :, :, :2], rtol=0, atol=1e-12)
    four = target.new_cache(4, 16)  # four rows, then three in the same storage: the padded row starts over
    runner.run(torch.tensor([[5], [6], [7], [8]]), four, "all", None, None)
    four.take_rows([0, 1, 2])
    runner.run(torch.tensor([[5], [6], [7]]), four, "all", None, None)
    step = next(s for k, s in four.graphs.items() if k != "pool" and k[1:3] == (4, 1))  # the cache's own graphs
    assert step.length.tolist() == [1, 1, 1, 0]


def test_cuda_graphs_option(llama_pair):
    target, draft = llama_pair
    llm = LLM(target, draft, method="ragged", dtype="float64")  # the CPU: no graphs by default
    assert llm.target.graph_runner is None and llm.draft.graph_runner is None
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        LLM(target, draft, method="ragged", dtype="float64", cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cuda_graphs \(--cuda-graphs\) must be True, False or None"):
        LLM(target, method="ar", dtype="float64", cuda_graphs="yes")
    assert LLM(target, method="ar", dtype="float64", cuda_graphs=False).target.graph_runner is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real capture needs a CUDA device")
def test_the_real_capture_replays_the_eager_step(llama_pair):
    """torch.cuda's capture: a batch of 5 replays its bucket-8 graph and gives the eager step's logits."""
    target = load_model(llama_pair[0], dtype="float32", device="cuda").use_graphs()
    graphed, eager = target.new_cache(5, 64), target.new_cache(5, 64)
    runner = target.graph_runner
    for t in range(6):
        ids = torch.arange(5, device="cuda")[:, None] + 10 + t  # [5, 1]
        out = target.forward(ids, graphed)
        target.graph_runner = None
        want = target.forward(ids, eager)
        target.graph_runner = runner
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert runner.failed is None and any(s.graph is not None for s in runner.live_steps())
