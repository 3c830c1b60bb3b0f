"""A decoding step reads the device exactly once (issue: the decode step without host round-trips; the
Engine issue: steps that admit or abort requests included).

Every read of a device value is counted: `aten._local_scalar_dense` / `aten.item` / `aten.is_nonzero`
(what `int(t)`, `float(t)`, `bool(t)` and `t.item()` dispatch to; which one fires depends on inference
mode) through a TorchDispatchMode, plus `Tensor.tolist`, which reads memory without dispatching. Each
`Engine.step` may also admit requests: each prefill reads its first tokens once, and is counted apart
(a step's reads = 1 if it decoded + 1 per prefill); an abort reads nothing. On a GPU each read would
stall the launch queue; on the CPU the same count shows the step is planned from host-side numbers alone.
"""
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec.engine as engine_module
import specdec.schedulers.continuous as continuous
import specdec.schedulers.exspec as exspec
from specdec import LLM, SamplingParams

SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero"}


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ in SYNC_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def pair(llama_pair):
    return llama_pair


def mixed_requests(n=8, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(2, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, top_k=0 if i % 4 else 20,
                             seed=i) for i in range(n)]
    return prompts, params


def reads_per_step(llm, prompts, params, monkeypatch, arrive_at=None, abort_at=None):
    """(device reads, prefills, decoded) of every Engine.step of a run; request i joins at step
    arrive_at[i] (default 0) and is aborted at abort_at[i]."""
    counter = SyncCounter()
    prefills = [0]
    original_tolist = torch.Tensor.tolist

    def counted_tolist(self):
        if not counter.paused:
            counter.count += 1
        return original_tolist(self)

    def counted_prefill(fn):
        def wrapper(*args, **kwargs):
            prefills[0] += 1
            return fn(*args, **kwargs)
        return wrapper

    for module in (continuous, exspec):
        monkeypatch.setattr(module, "prefill", counted_prefill(module.prefill))
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    arrive_at = arrive_at or [0] * len(prompts)
    abort_at = abort_at or {}
    engine = llm.engine()
    steps = []
    with counter:
        for step in range(10_000):
            for i, when in enumerate(arrive_at):
                if when == step:
                    engine.add_request(prompts[i], params[i], request_id=str(i))
            for i, when in abort_at.items():
                if when == step:
                    engine.abort(str(i))
            before = (counter.count, prefills[0], engine.metrics.steps)
            engine.step()
            steps.append((counter.count - before[0], prefills[0] - before[1], engine.metrics.steps - before[2]))
            if step >= max(arrive_at) and not engine.has_unfinished():
                return steps
    raise AssertionError("did not finish")


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec"])
@pytest.mark.parametrize("k", [5, "auto"])
def test_one_device_read_per_step(pair, method, k, monkeypatch):
    target, draft = pair
    prompts, params = mixed_requests()
    llm = LLM(target, draft, method=method, num_speculative_tokens=k, batch_size=8, dtype="float32",
              check_invariants=False, cost_cache="")
    steps = reads_per_step(llm, prompts, params, monkeypatch)
    assert all(reads == decoded + prefills for reads, prefills, decoded in steps), f"{method} k={k}: {steps}"
    assert sum(d for _, _, d in steps) > 5 and any(p == 0 and d == 1 for _, p, d in steps)


@pytest.mark.parametrize("method", ["ar", "eqspec", "ragged", "exspec"])
def test_admitting_and_aborting_steps_read_once_more_per_prefill(pair, method, monkeypatch):
    """Requests arriving and aborted mid-run: a step reads once for its decode, once per prefill it ran."""
    target, draft = pair
    prompts, params = mixed_requests(n=12, seed=1)
    arrive_at = [0, 0, 0, 2, 3, 3, 5, 8, 8, 9, 12, 15]
    llm = LLM(target, None if method == "ar" else draft, method=method, num_speculative_tokens=3, batch_size=4,
              dtype="float32", check_invariants=False, cost_cache="")
    steps = reads_per_step(llm, prompts, params, monkeypatch, arrive_at, abort_at={1: 2, 4: 4, 9: 9})
    assert all(reads == decoded + prefills for reads, prefills, decoded in steps), f"{method}: {steps}"
    assert any(p > 0 and d == 1 for _, p, d in steps)  # steps that admitted and decoded were seen


def test_counter_sees_a_hidden_read(pair, monkeypatch):
    """The counter has teeth: a `bool(tensor)` slipped into the step is counted."""
    target, draft = pair
    prompts, params = mixed_requests()
    original = engine_module.decode_step

    def with_hidden_read(ctx, batch):
        bool((batch.seq_len > 0).all())
        return original(ctx, batch)

    monkeypatch.setattr(engine_module, "decode_step", with_hidden_read)
    llm = LLM(target, draft, method="exspec", num_speculative_tokens=5, batch_size=8, dtype="float32",
              check_invariants=False)
    steps = reads_per_step(llm, prompts, params, monkeypatch)
    assert all(reads == decoded + prefills + decoded for reads, prefills, decoded in steps)


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec"])
def test_feature_draft_steps_read_once(pair, method, monkeypatch):
    """A feature draft (the target's hidden states stored and gathered on the device) adds no read."""
    from specdec.models import load_model
    from test_feature_draft import make_feature_draft

    target = load_model(pair[0], dtype="float32")
    prompts, params = mixed_requests(n=10, seed=2)
    llm = LLM(target, make_feature_draft(target), method=method, num_speculative_tokens=3, batch_size=4,
              check_invariants=False, cost_cache="")
    steps = reads_per_step(llm, prompts, params, monkeypatch, arrive_at=[0, 0, 0, 1, 2, 2, 4, 6, 6, 7])
    assert all(reads == decoded + prefills for reads, prefills, decoded in steps), f"{method}: {steps}"


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec"])
@pytest.mark.parametrize("drafter", ["ngram", "suffix", "model+suffix"])
def test_lookup_steps_read_once(pair, method, drafter, monkeypatch):
    """Drafts planned on the host (ngram, suffix, a lookup beside the model) go to the device, never back."""
    target, draft = pair
    prompts, params = mixed_requests(n=10, seed=3)
    prompts = [p + p for p in prompts]  # repeats: the lookups find matches
    kwargs = dict(draft=draft, lookup="suffix") if drafter.startswith("model") else dict(draft=drafter)
    llm = LLM(target, method=method, num_speculative_tokens="auto", batch_size=4, check_invariants=False,
              cost_cache="", **kwargs)
    steps = reads_per_step(llm, prompts, params, monkeypatch, arrive_at=[0, 0, 0, 1, 2, 2, 4, 6, 6, 7])
    assert all(reads == decoded + prefills for reads, prefills, decoded in steps), f"{method}: {steps}"
    assert sum(d for _, _, d in steps) > 5


class OpCounter(TorchDispatchMode):
    """Counts the calls of some aten ops (by name: which one dispatches depends on inference mode)."""

    def __init__(self, *names):
        super().__init__()
        self.names, self.count = names, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.names:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["ar", "eqspec", "ragged", "exspec"])
def test_logprobs_ride_in_the_one_read_and_cost_nothing_when_nobody_asks(pair, method, monkeypatch):
    """Rows asking for logprobs (some rows, mixed top counts; admissions and aborts mid-run): still one read
    per step and one per prefill. A run where no row asks computes no log_softmax at all."""
    import dataclasses

    target, draft = pair
    prompts, params = mixed_requests(n=12, seed=4)
    asking = [dataclasses.replace(p, logprobs=[None, 0, 3, 5][i % 4]) for i, p in enumerate(params)]
    llm = LLM(target, None if method == "ar" else draft, method=method, num_speculative_tokens=3, batch_size=4,
              dtype="float32", check_invariants=False, cost_cache="")
    arrive_at = [0, 0, 0, 2, 3, 3, 5, 8, 8, 9, 12, 15]
    steps = reads_per_step(llm, prompts, asking, monkeypatch, arrive_at, abort_at={1: 2, 6: 7})
    assert all(reads == decoded + prefills for reads, prefills, decoded in steps), f"{method}: {steps}"
    for asked, counted in ((params, 0), (asking, None)):
        ops = OpCounter("log_softmax", "_log_softmax")
        with ops:
            llm.generate(prompt_token_ids=prompts, sampling_params=asked)
        assert ops.count == 0 if counted == 0 else ops.count > 0
