"""End to end: EQSPEC and RAGGED with every kernel on the Triton path (interpreter on CPU) emit the same
token ids as with the torch references, greedy and sampled."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from checkpoints import make_pair  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair("glm4", tmp_path_factory.mktemp("e2e"))


@pytest.mark.parametrize("method", ["eqspec", "ragged"])
def test_triton_path_equals_torch_path(pair, method, monkeypatch):
    target, draft = pair
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [15, 16]]
    params = [SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=1),
              SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.2, top_k=30, seed=2)]

    def run(backend):
        monkeypatch.setenv("SPECDEC_KERNELS", backend)
        llm = LLM(target, draft, method=method, num_speculative_tokens=3, batch_size=3, dtype="float64")
        return llm.generate(prompt_token_ids=prompts, sampling_params=params)

    torch_outs, triton_outs = run("torch"), run("triton")
    assert [o.token_ids for o in triton_outs] == [o.token_ids for o in torch_outs]
    assert [o.accepted_counts for o in triton_outs] == [o.accepted_counts for o in torch_outs]
    assert 0 < torch_outs.metrics.acceptance_rate < 1
