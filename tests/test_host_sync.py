"""A decoding step reads the device at most twice (issue: the decode step without host round-trips).

Every read of a device value is counted: `aten._local_scalar_dense` / `aten.item` / `aten.is_nonzero`
(what `int(t)`, `float(t)`, `bool(t)` and `t.item()` dispatch to; which one fires depends on inference
mode) through a TorchDispatchMode, plus `Tensor.tolist`, which reads memory without dispatching. Prefill
(admitting new requests) is not part of a step and is not counted. On a GPU each read would stall the
launch queue; on the CPU the same count shows the step is planned from host-side numbers alone.
"""
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec.strategies.continuous as continuous
import specdec.strategies.eqspec as eqspec
import specdec.strategies.exspec as exspec
from checkpoints import make_pair
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
def pair(tmp_path_factory):
    return make_pair("llama", tmp_path_factory.mktemp("sync"))


def mixed_requests(n=8, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(2, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, top_k=0 if i % 4 else 20,
                             seed=i) for i in range(n)]
    return prompts, params


def syncs_per_step(llm, prompts, params, monkeypatch):
    """Device reads in each step of a run (prefill excluded), one entry per step."""
    counter = SyncCounter()
    boundaries = []
    original_tolist = torch.Tensor.tolist

    def counted_tolist(self):
        if not counter.paused:
            counter.count += 1
        return original_tolist(self)

    def paused(fn):
        def wrapper(*args, **kwargs):
            counter.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.paused -= 1
        return wrapper

    def marked(fn):
        def wrapper(*args, **kwargs):
            boundaries.append(counter.count)
            return fn(*args, **kwargs)
        return wrapper

    for module in (continuous, eqspec):
        monkeypatch.setattr(module, "prefill", paused(module.prefill))
    for module in (continuous, eqspec, exspec):
        monkeypatch.setattr(module, "decode_step", marked(module.decode_step))
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with counter:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    boundaries.append(counter.count)
    per_step = [b - a for a, b in zip(boundaries, boundaries[1:])]
    assert len(per_step) == outs.metrics.steps
    return per_step


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec"])
@pytest.mark.parametrize("k", [5, "auto"])
def test_at_most_two_device_reads_per_step(pair, method, k, monkeypatch):
    target, draft = pair
    prompts, params = mixed_requests()
    llm = LLM(target, draft, method=method, num_speculative_tokens=k, batch_size=8, dtype="float32",
              check_invariants=False, cost_cache="")
    per_step = syncs_per_step(llm, prompts, params, monkeypatch)
    assert max(per_step) <= 2, f"{method} k={k}: device reads per step {per_step}"
    assert min(per_step) >= 1  # the step's one read of its results is seen: the counter works


def test_ar_reads_the_device_once_per_step(pair, monkeypatch):
    target, _ = pair
    prompts, params = mixed_requests()
    llm = LLM(target, method="ar", batch_size=8, dtype="float32", check_invariants=False)
    assert set(syncs_per_step(llm, prompts, params, monkeypatch)) == {1}


def test_counter_sees_a_hidden_read(pair, monkeypatch):
    """The counter has teeth: a `bool(tensor)` slipped into the step is counted."""
    target, draft = pair
    prompts, params = mixed_requests()
    original = exspec.decode_step

    def with_hidden_read(ctx, batch):
        bool((batch.seq_len > 0).all())
        return original(ctx, batch)

    monkeypatch.setattr(exspec, "decode_step", with_hidden_read)
    llm = LLM(target, draft, method="exspec", num_speculative_tokens=5, batch_size=8, dtype="float32",
              check_invariants=False)
    assert min(syncs_per_step(llm, prompts, params, monkeypatch)) >= 2  # the read plus the hidden one
