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
        llm = LLM(target, draft, method=method, num_speculative_tokens=3, batch_size=3, dtype="float64",
                  kernel_backend=backend)
        return llm.generate(prompt_token_ids=prompts, sampling_params=params)

    torch_outs, triton_outs = run("torch"), run("triton")
    assert [o.token_ids for o in triton_outs] == [o.token_ids for o in torch_outs]
    assert [o.accepted_counts for o in triton_outs] == [o.accepted_counts for o in torch_outs]
    assert 0 < torch_outs.metrics.acceptance_rate < 1


def test_kernel_backend_option_reaches_every_kernel(pair, monkeypatch):
    """`LLM(kernel_backend="triton")` sends every kernel through Triton -- the forward's positions/mask plan
    and KV scatter too, not just rejection sampling and realignment -- and "torch" sends none."""
    import specdec.kernels.kv_append as kva
    import specdec.kernels.positions as pos
    import specdec.kernels.realign as rea
    import specdec.kernels.rejection as rej

    calls = set()
    for mod, name in ((pos, "step_plan"), (kva, "kv_append"), (rea, "realign"), (rej, "rejection_sample")):
        real = getattr(mod, f"{name}_triton")

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.add(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, f"{name}_triton", spy)
    target, draft = pair
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for backend in ("torch", "triton"):
        calls.clear()
        for method in ("eqspec", "ragged"):  # eqspec realigns; ragged scatters K/V at per-row columns
            LLM(target, draft, method=method, num_speculative_tokens=3, batch_size=5, dtype="float64",
                kernel_backend=backend).generate(prompt_token_ids=prompts, sampling_params=params)
        assert calls == (set() if backend == "torch" else {"step_plan", "kv_append", "realign", "rejection_sample"})
