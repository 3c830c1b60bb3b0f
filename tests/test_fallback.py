"""Where the CPU quantized kernel is not built (issue 57): one fallback, exact in what matters. A BlockLinear then
multiplies a float32 copy of its weight, made at load and said in the load line, by the activations as the kernel
multiplies them, through the batch-invariant linear: each row's bits independent of the batch, so every method's
greedy output equals AR's; the values equal the kernel's reference to float32 rounding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.kernels import qmm_cpu
from specdec.models.ggml_blocks import decompose, pack
from specdec.models.quant import BlockLinear
from test_ggml_blocks import random_raw

gguf = pytest.importorskip("gguf")
NOT_BUILT = "the CPU quantized kernel is not built (test)"


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.setattr(qmm_cpu, "_library", lambda: (None, NOT_BUILT))
    assert not qmm_cpu.available()


def layer(qtypes=("Q4_K", "Q6_K"), n=(40, 24), k=256, seed=0):
    rng = np.random.default_rng(seed)
    parts, row = [], 0
    for qtype, rows in zip(qtypes, n):
        raw = random_raw(rng, qtype, rows, k)
        parts.append((row, pack(decompose(raw, qtype), qtype)))
        row += rows
    return BlockLinear(parts)


def test_the_fallback_layer_is_the_reference_to_rounding_and_row_invariant(no_kernel):
    lin = layer()
    assert lin.float_weight is not None and lin.float_copy_bytes >= lin.float_weight.numel() * 4  # made at build
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 256, generator=g)
    y = lin(x)  # [9, 64]
    ref = torch.cat([qmm_cpu.qmm_reference(x, p) for _, p in lin.parts], dim=-1).double()
    xs = qmm_cpu.activations_as_multiplied(x)  # [9, K] float64
    scale = xs.abs() @ lin.dequantize().double().abs().t()  # [9, 64] what float32 rounding is relative to
    assert ((y.double() - ref).abs() <= 1e-5 * scale + 1e-30).all()
    for rows in (1, 2, 5, 9):  # a row's bits whatever else is in the call
        assert torch.equal(lin(x[:rows]).view(torch.int32), y[:rows].view(torch.int32)), rows
    assert torch.equal(lin(x[4:5]).view(torch.int32), y[4:5].view(torch.int32))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from checkpoints import build_hf_model
    from real_model import write_gguf

    hf = build_hf_model("llama", seed=1, hidden_size=64, intermediate_size=96)
    path = tmp_path_factory.mktemp("fallback") / "tiny-Q8_0.gguf"
    write_gguf(path, hf.config, hf.state_dict(), qtype=gguf.GGMLQuantizationType.Q8_0)
    return path


def test_a_load_without_the_kernel_makes_the_copies_and_says_so_in_one_line(tiny_gguf, no_kernel, capsys):
    from specdec.models import load_model

    model = load_model(tiny_gguf)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and NOT_BUILT in err[0] and "GiB, made at load" in err[0] and "equals AR" in err[0]
    copies = [m.float_weight for m in model.modules() if isinstance(m, BlockLinear)]
    assert copies and all(c is not None for c in copies)  # before any forward: counted by what follows
    assert model.native is None and NOT_BUILT in model.native_reason


def test_the_fallbacks_logits_are_the_kernels_to_rounding(tiny_gguf, monkeypatch):
    from specdec.models import load_model

    built = load_model(tiny_gguf)
    monkeypatch.setattr(qmm_cpu, "_library", lambda: (None, NOT_BUILT))
    fallback = load_model(tiny_gguf)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7, 1, 130, 64, 12]])
    with torch.no_grad():
        a = built(ids, built.new_cache(1, 12))[0]  # [10, V]
        b = fallback(ids, fallback.new_cache(1, 12))[0]
    per_token = (a - b).abs().amax(-1)  # rounding everywhere; a flipped int8 code moves one position
    assert per_token.median() <= 1e-4 * b.abs().max() and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_every_method_equals_ar_without_the_kernel(tiny_gguf, no_kernel):
    from specdec import LLM, SamplingParams
    from specdec.models import load_model

    target = load_model(tiny_gguf)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 131, size=int(rng.integers(3, 18))).tolist() for _ in range(5)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    common = dict(cost_cache="", check_invariants=True)
    want = [o.token_ids for o in LLM(target, method="ar", batch_size=1, **common).generate(
        prompt_token_ids=prompts, sampling_params=params)]
    for method, drafter, k, batch in (("ar", None, None, 4), ("eqspec", "ngram", 3, 3), ("ragged", "suffix", 4, 4),
                                      ("exspec", target, 2, 2)):
        llm = LLM(target, drafter, method=method, num_speculative_tokens=k, batch_size=batch, window_size=4, **common)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want, (method, drafter)
