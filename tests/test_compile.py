"""`LLM(compile=True)`: the torch.compile'd forwards (inductor on CPU) give AR's tokens exactly in float64,
for AR and the speculative strategies, and one compilation serves every batch size and step length.

Compiling is slow on a small CPU, so CI runs one small case here; the whole equivalence, sampling and
failure-mode suites run compiled with `SPECDEC_COMPILE=1 python -m pytest tests/test_equivalence.py ...`
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
    for method in ("ar", "ragged", "eqspec"):
        llm = LLM(target, None if method == "ar" else draft, method=method, num_speculative_tokens=3, batch_size=4,
                  dtype="float64", compile=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        assert [o.token_ids for o in outs] == expected, method
        assert llm.target.compiled_forward is not None


def test_a_compile_mode_enters_as_options(pair):
    """`--compile` on CUDA asks for "reduce-overhead" (CUDA graphs); torch.compile refuses a mode together with
    options (the H200 run's "Either mode or options can be specified"), so the mode goes in as its options."""
    from specdec.models import load_model

    model = load_model(pair[0], dtype="float64")
    model.compile_forward("reduce-overhead")  # torch.compile is lazy: nothing compiles until a call
    assert model.compiled_forward is not None and model._compile_mode == "reduce-overhead"
