"""`LLM(compile=True)`: the torch.compile'd forwards (inductor on CPU) give AR's tokens exactly in float64,
for AR and the speculative strategies, and one compilation serves every batch size and step length.

Compiling is slow on a small CPU, so CI runs one small case here; the whole equivalence, sampling and
failure-mode suites run compiled with `SPECDEC_TEST_COMPILE=1 python -m pytest tests/test_equivalence.py ...`
(docs/api.md)."""
import random

import pytest
import torch

from checkpoints import make_pair
from specdec import LLM, SamplingParams

pytestmark = pytest.mark.slow  # not in the fast lane (pytest.ini)

PARAMS = SamplingParams(max_tokens=16)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair("llama", tmp_path_factory.mktemp("compile"), num_hidden_layers=1)


def test_compiled_equals_eager(pair):
    target, draft = pair
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    expected = [o.token_ids for o in LLM(target, method="ar", batch_size=1, dtype="float64", compile=False).generate(
        prompt_token_ids=prompts, sampling_params=PARAMS)]
    torch._dynamo.reset()
    for method in ("ar", "ragged", "eqspec"):  # the two layouts' forwards (exspec runs the ragged one: a compile less)
        # the draft model's k drafts every step (no lookup beside it): one verify width, the fewest graphs to build
        llm = LLM(target, None if method == "ar" else draft, method=method, num_speculative_tokens=3, batch_size=4,
                  dtype="float64", compile=True, lookup=None)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        assert [o.token_ids for o in outs] == expected, method
        assert llm.target.compiled_forward is not None


def test_a_compile_mode_enters_as_options(pair):
    """torch.compile refuses a mode together with options (the H200 run's "Either mode or options can be
    specified"), so a mode goes in as its options; a mode that captures CUDA graphs is refused (models/graphs.py
    is the one capture mechanism)."""
    from specdec.models import load_model

    from torch._inductor import list_mode_options

    model = load_model(pair[0], dtype="float64")
    seen = []
    real_compile = torch.compile

    def spy(fn, **kwargs):  # injected faults this catches: `mode=` passed beside `options=` (torch refuses the
        seen.append(kwargs)  # pair), or the mode's own options dropped on the way in
        assert not ("mode" in kwargs and "options" in kwargs), "torch.compile takes a mode or options, not both"
        return real_compile(fn, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", spy)
        model.compile_forward("max-autotune-no-cudagraphs")  # torch.compile is lazy: nothing compiles until a call
    assert model.compiled_forward is not None and model._compile_mode == "max-autotune-no-cudagraphs"
    assert len(seen) == 1 and "mode" not in seen[0]
    options = seen[0]["options"]
    assert list_mode_options("max-autotune-no-cudagraphs").items() <= options.items()  # the mode, as options
    assert options.get("emulate_precision_casts") is True
    with pytest.raises(ValueError, match="captures CUDA graphs"):
        model.compile_forward("reduce-overhead")


def test_many_compiled_models_fit_in_dynamo_s_cache(tmp_path, monkeypatch):
    """Every compiled model shares `forward_tensors`' code, whose cache entries dynamo counts together (8 by
    default; with fullgraph=True one more is a hard error, where bench/throughput.py --compile's exspec runs
    stopped, on the CPU and on the H200). Three architectures (1, 2 and 3 layers) x 4 graphs (1 or 2 rows, 1 or
    2 new tokens) run, traced by dynamo with its "eager" backend (the cache is dynamo's; inductor's code
    generation would only add a minute)."""
    from checkpoints import make_checkpoint
    from specdec.models import load_model

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, fullgraph, options: compile_(fn, fullgraph=fullgraph,
                                                                                  backend="eager"))
    torch._dynamo.reset()
    for layers in (1, 2, 3):
        model = load_model(make_checkpoint("llama", tmp_path / f"l{layers}", num_hidden_layers=layers),
                           dtype="float64").compile_forward()
        for rows in (1, 2):
            cache = model.new_cache(rows, 16)
            model(torch.tensor([[5, 6, 7]] * rows), cache)  # the prefill runs eager
            for T in (1, 2):
                model(torch.tensor([[8] * T] * rows), cache)


def test_compiled_step_compiles_once_per_bucket_and_never_again(pair, monkeypatch):
    """The step captured with fullgraph=True (any graph break -- a host sync, a Python branch on a tensor value
    -- is an error): a 64-token AR run at batch 1 compiles the step once, speculative runs once per bucket
    (rows 1 or more, one new token or several), and running again, or longer, compiles nothing. Traced by
    dynamo's "eager" backend (what recompiles is dynamo's decision; inductor would only add minutes)."""
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, fullgraph, options: compile_(fn, fullgraph=fullgraph,
                                                                                  backend="eager"))
    target, draft = pair
    long = SamplingParams(max_tokens=64, ignore_eos=True)
    torch._dynamo.reset()
    counters.clear()
    ar = LLM(target, method="ar", batch_size=1, dtype="float32", compile=True)
    ar.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    ar.generate(prompt_token_ids=[[9, 10, 11, 12, 13]], sampling_params=long)  # another prompt length
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["recompiles"])
    # draft_confidence=0: the same drafts every run (a stop threshold priced from measured times is not)
    spec = LLM(target, draft, method="ragged", num_speculative_tokens=3, batch_size=4, dtype="float32", compile=True,
               draft_confidence=0)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
    spec.generate(prompt_token_ids=prompts, sampling_params=long)
    spec.generate(prompt_token_ids=prompts[::-1], sampling_params=long)  # may reach a bucket the first run did not
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 1 + 2 * 4, dict(counters["stats"])  # AR's, then at most 4 per model (rows, new tokens)
    assert not counters["recompiles"], dict(counters["recompiles"])
    spec.generate(prompt_token_ids=prompts, sampling_params=long)  # the same run again compiles nothing
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["recompiles"])
