"""Weight-only quantized models (models/quant.py): the GGUF Q4 blocks taken as stored, int8/int4 quantization
within its rounding, the kernels row-invariant, loading bounded and strict, and speculative output equal
to the same quantized target's AR output for every method and drafter."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from checkpoints import build_hf_model, make_pair
from real_model import write_gguf
from specdec import LLM, SamplingParams
from specdec.models import load_model
from specdec.models.errors import CheckpointError
from specdec.models.gguf import Q4_K_BLOCK_BYTES, Q4_TYPES, q4_codes, q4k_codes
from specdec.models.quant import (FORMATS, GROUP, QuantEmbedding, QuantizationError, QuantLinear, QuantRows,
                                  dequantize_int4, quantize_int4_rows, quantize_int8_rows)

gguf = pytest.importorskip("gguf")
BF16_EPS = 2.0 ** -8  # bfloat16's relative rounding step (8 significand bits)


def bf16_tolerance(x, w):
    """A bound on |x W^T| errors from rounding x and the product to bfloat16: a few steps of |x| |W|^T."""
    return 4 * BF16_EPS * (x.abs() @ w.abs().t()) + 1e-6


@pytest.mark.parametrize("qtype", sorted(Q4_TYPES))
def test_q4_blocks_as_stored_equal_the_gguf_library_dequantization(qtype):
    w = torch.randn(48, 4 * GROUP).numpy()  # [N, K]
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])  # uint8 [N, bytes]
    reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])).float()
    codes, scales, zeros = q4_codes(raw, qtype)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert torch.equal(dequantize_int4(codes, scales, zeros), reference)  # the file's numbers exactly
    layer = QuantLinear("int4", codes, scales, zeros)
    # the kernel's scales are bfloat16 (the one rounding taken on the file's float16 d and m)
    tol = (8 * scales.abs().repeat_interleave(GROUP, 1) + zeros.abs().repeat_interleave(GROUP, 1)
           + reference.abs()) * 2 * BF16_EPS
    assert ((layer.dequantize() - reference).abs() <= tol + 1e-7).all()
    x = torch.randn(5, 4 * GROUP)
    assert ((layer(x) - x @ reference.t()).abs() <= bf16_tolerance(x, reference) + x.abs() @ tol.t()).all()


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """A plain Q4_K encoder (the gguf library has none): w float32 [N, K] (K % 256 == 0) -> uint8 [N, K/256 * 144].
    Each sub-block of 32 maps [min(w, 0), max(w)] onto codes 0..15; w = d sc q - dmin m."""
    N, K = w.shape
    sub = w.reshape(N, K // 256, 8, 32)  # [N, S, 8, 32]
    lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)  # [N, S, 8]
    step, low = (hi - lo) / 15, -lo  # the sub-blocks' ideal scale and min
    d = (step.max(-1) / 63).astype(np.float16)  # [N, S]
    dmin = (low.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]  # [N, S, 1]
    sc = np.clip(np.round(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(low, dminf, out=np.zeros_like(low), where=dminf > 0)), 0, 63).astype(np.uint8)
    scale, offset = (df * sc)[..., None], (dminf * m)[..., None]  # [N, S, 8, 1]
    q = np.clip(np.round(np.divide(sub + offset, scale, out=np.zeros_like(sub), where=scale > 0)), 0, 15)
    q = q.astype(np.uint8).reshape(N, K // 256, 4, 2, 32)  # sub-blocks 2c and 2c + 1 share bytes 32c..32c+31
    packed = np.concatenate((  # [N, S, 12]: see models/gguf.py q4k_scales_mins
        (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6), (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)), axis=-1)
    blocks = np.concatenate((d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed,
                             (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(N, K // 256, 128)), axis=-1)
    return np.ascontiguousarray(blocks.reshape(N, -1))


def test_q4_k_blocks_as_stored_equal_the_gguf_library_dequantization():
    """Q4_K super-blocks (random bytes: every scale and min bit pattern, and an encoded float weight) as int4
    groups of 32: exactly the file's numbers in float32, and within the bfloat16 rounding of scale and zero
    as the layer holds them."""
    rng = np.random.default_rng(0)
    random_bytes = rng.integers(0, 256, size=(6, 2 * Q4_K_BLOCK_BYTES), dtype=np.uint8)  # [N, 2 super-blocks]
    halves = rng.uniform(1e-4, 1e-2, size=(6, 2, 2)).astype(np.float16).view(np.uint8)  # d, dmin: positive
    random_bytes.reshape(6, 2, Q4_K_BLOCK_BYTES)[..., :4] = halves.reshape(6, 2, 4)
    encoded = encode_q4_k(rng.standard_normal((10, 512)).astype(np.float32))
    for raw in (random_bytes, encoded):
        reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)).float()
        codes, scales, zeros = q4k_codes(raw)
        assert codes.shape == reference.shape and int(codes.max()) <= 15 and scales.shape[1] == 512 // GROUP
        ours = dequantize_int4(codes, scales, zeros)
        assert (ours - reference).abs().max() <= 1e-6 * reference.abs().max()  # float32 rounding of zero only
        layer = QuantLinear("int4", codes, scales, zeros)
        tol = (8 * scales.abs().repeat_interleave(GROUP, 1) + zeros.abs().repeat_interleave(GROUP, 1)
               + reference.abs()) * 2 * BF16_EPS
        assert ((layer.dequantize() - reference).abs() <= tol + 1e-7).all()
    w = rng.standard_normal((10, 512)).astype(np.float32)  # the encoder is a real quantizer (checks the test)
    back = gguf.quants.dequantize(encode_q4_k(w), gguf.GGMLQuantizationType.Q4_K)
    assert np.abs(back - w).max() < 0.25 * np.abs(w).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantization_error_is_within_half_a_step(fmt):
    w = torch.randn(40, 3 * GROUP) * torch.linspace(0.1, 3, 40)[:, None]  # rows of different ranges
    if fmt == "int4":
        codes, scales, zeros = quantize_int4_rows(w)
        back = dequantize_int4(codes, scales, zeros)
        step = scales.repeat_interleave(GROUP, 1) + 2 * zeros.abs().repeat_interleave(GROUP, 1) * BF16_EPS
    else:
        codes, scales = quantize_int8_rows(w)
        back = codes.float() * scales[:, None]
        step = scales[:, None].expand_as(w)
    assert ((back - w).abs() <= step * (0.5 + 1e-3) + w.abs() * BF16_EPS).all()
    layer = QuantLinear(fmt, codes, scales, zeros if fmt == "int4" else None)
    assert torch.allclose(layer.dequantize(), back, rtol=2 * BF16_EPS, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_compute_every_row_on_its_own(fmt):
    """A token's output is the same bits alone and among others (what batch invariance needs)."""
    w = torch.randn(96, 64)
    rows = QuantRows(fmt, (96, 64), "w")
    rows.add_float(0, w)
    layer = rows.module(bias=torch.randn(96))
    x = torch.randn(13, 64)
    full = layer(x)  # [13, 96]
    for m in (1, 2, 5, 13):
        assert torch.equal(layer(x[:m]), full[:m])
    assert torch.equal(torch.cat([layer(x[i: i + 1]) for i in range(13)]), full)
    assert torch.equal(layer(x.view(1, 13, 64))[0], full)  # any leading shape


def test_int4_needs_whole_groups_and_says_which_tensor():
    with pytest.raises(QuantizationError, match="blk.0.ffn_down.*divisible by 32"):
        QuantRows("int4", (8, 48), "model.gguf: tensor 'blk.0.ffn_down.weight'")


def hidden_states_agree(quantized, reference, ids, top1: float, rel: float):
    """The quantized model's logits near the float model's: top-1 agreement, and the relative error."""
    with torch.no_grad():
        a = quantized(torch.tensor([ids]), quantized.new_cache(1, len(ids)))[0]  # [T, V]
        b = reference(torch.tensor([ids]), reference.new_cache(1, len(ids)))[0]
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree >= top1, f"top-1 agreement {agree:.2f}"
    error = ((a - b).norm() / b.norm()).item()
    assert error <= rel, f"relative error {error:.3f}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_safetensors_checkpoint_quantized_at_load(llama_pair, fmt):
    target, _ = llama_pair
    ref = load_model(target)
    model = load_model(target, quantize=fmt)
    assert model.quantize == fmt and model.batch_invariant
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears == []  # every linear weight is quantized: no float copy is kept
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.lm_head.format == "int8"
    assert model.layers[0].mlp.gate_up_proj.format == fmt
    ids = [5, 17, 3, 99, 42, 7, 1, 130, 8, 8, 64]
    # 4 bits: ~8% weight error; the CPU kernel also rounds the activations to int8 per 32 (llama.cpp's Q8_0): on
    # this tiny random model's near-flat logits 7 of the 11 top-1s agree (SmolLM2 Q4_1: 96.4%, docs/kernels.md)
    hidden_states_agree(model, ref, ids, top1=0.6 if fmt == "int4" else 0.7, rel=0.35 if fmt == "int4" else 0.03)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_gguf_quantized_types_load_quantized(tmp_path, qtype):
    hf = build_hf_model("llama", seed=1, hidden_size=64, intermediate_size=96)
    path = tmp_path / f"llama-{qtype}.gguf"
    write_gguf(path, hf.config, hf.state_dict(), qtype=gguf.GGMLQuantizationType[qtype])
    floats = load_model(path, dtype="float32")  # the file dequantized to float32: the reference
    as_stored = qtype != "F16"
    model = load_model(path) if as_stored else load_model(path, quantize="int4")  # the default: blocks as stored
    assert model.quantize == ("gguf" if as_stored else "int4")
    for name in ("layers.0.self_attn.qkv_proj", "layers.2.mlp.gate_up_proj", "layers.1.mlp.down_proj"):
        layer = model.get_submodule(name)
        want = floats.get_submodule(name).weight
        if as_stored:  # the file's own numbers, exactly
            assert layer.parts[0][1].qtype == qtype and torch.equal(layer.dequantize(), want), name
        else:  # quantized from floats: half a step of a group's range / 15
            err = (layer.dequantize() - want).abs().max().item()
            assert err <= want.abs().max().item() / 15, f"{name}: {err}"
    if as_stored:  # the same weights as the float load; the activations rounded to int8 per 32 by the kernel
        hidden_states_agree(model, floats, [5, 17, 3, 99, 42, 7, 1, 100], top1=0.75, rel=0.03)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])
def test_llama_qk_permutation_is_undone_on_quantized_rows(tmp_path, monkeypatch, qtype):
    """A Q4 file's Q/K rows as stored are llama.cpp's order: the codes, scales and zeros move with them."""
    hf = build_hf_model("llama", seed=4, hidden_size=256, intermediate_size=256)  # Q4_K: rows of 256
    quantize = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", lambda a, kind: encode_q4_k(a)  # the library has no Q4_K encoder
                        if kind == gguf.GGMLQuantizationType.Q4_K else quantize(a, kind))
    path = tmp_path / f"llama-{qtype}.gguf"
    write_gguf(path, hf.config, hf.state_dict(), qtype=gguf.GGMLQuantizationType[qtype])
    floats, model = load_model(path, dtype="float32"), load_model(path)
    for name in ("layers.1.self_attn.qkv_proj", "layers.0.mlp.down_proj"):
        want = floats.get_submodule(name).weight
        got = model.get_submodule(name).dequantize()
        assert torch.equal(got, want), name  # as stored: the file's numbers, the rows in HF's order


def test_untied_head_and_biases_quantize(tmp_path):
    target = make_pair("glm4", tmp_path)[0]  # attention biases; untied head
    ref, model = load_model(target), load_model(target, quantize="int8")
    assert model.layers[0].self_attn.qkv_proj.bias is not None and model.lm_head is not model.embed_tokens
    hidden_states_agree(model, ref, [5, 17, 3, 99, 42, 7, 1, 100], top1=0.75, rel=0.06)


def test_bad_quantize_values_are_one_line(llama_pair):
    target, _ = llama_pair
    with pytest.raises(ValueError, match=r"quantize \(--quantize\) must be one of 'int8', 'int4' or None, got 'int3'"):
        load_model(target, quantize="int3")
    model = load_model(target)
    with pytest.raises(ValueError, match="this model object is not quantized"):
        LLM(model, method="ar", quantize="int4")


def test_check_weights_scans_the_quantized_scales(tmp_path):
    hf = build_hf_model("llama", seed=1)
    with torch.no_grad():
        hf.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    path = tmp_path / "nan"
    hf.save_pretrained(str(path))
    with pytest.raises(CheckpointError, match="mlp.up_proj.*non-finite"):
        load_model(path, quantize="int4", check_weights=True)


# ------------------------------------------------------------------------------------------ exactness
PARAMS = SamplingParams(max_tokens=24)


def prompts(n=6, vocab=131, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, vocab, size=int(rng.integers(4, 20))).tolist()
        out.append(base + base[: int(rng.integers(0, len(base)))] if i % 2 else base)  # planted repeats
    return out


@pytest.fixture(scope="module")
def quantized_pair(tmp_path_factory):
    return make_pair("llama", tmp_path_factory.mktemp("quant-pair"), seed=3)


@pytest.fixture(scope="module")
def gguf_target(quantized_pair, tmp_path_factory):
    """quantized_pair's target as a Q5_0 GGUF file (5-bit codes: the kernel's high plane), loaded as stored."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(quantized_pair[0], torch_dtype=torch.float32)
    path = tmp_path_factory.mktemp("quant-gguf") / "target-Q5_0.gguf"
    write_gguf(path, hf.config, hf.state_dict(), qtype=gguf.GGMLQuantizationType.Q5_0)
    return path


@pytest.mark.parametrize("fmt,dtype", [("int8", "float32"), ("int8", "bfloat16"), ("int4", "float32"),
                                       ("int4", "bfloat16"), ("gguf", None)])
def test_speculative_equals_quantized_ar(quantized_pair, gguf_target, fmt, dtype):
    """Every method and drafter gives the quantized target's own AR tokens: float checkpoints quantized at load
    (int8 / int4), and a GGUF file's blocks as stored (the default load of a quantized GGUF)."""
    target, draft = quantized_pair
    ids = prompts()
    kwargs = dict(quantize=fmt, dtype=dtype, check_invariants=True)
    if fmt == "gguf":  # the model object (its file carries no tokenizer): as the CPU loads it by default
        target, kwargs = load_model(gguf_target), dict(check_invariants=True)
        assert target.quantize == "gguf" and target.layers[0].mlp.gate_up_proj.parts[0][1].qtype == "Q5_0"
    if dtype == "bfloat16":
        kwargs["batch_invariant"] = True
    reference = [o.token_ids for o in LLM(target, method="ar", batch_size=1, **kwargs).generate(
        prompt_token_ids=ids, sampling_params=PARAMS)]
    cases = [("eqspec", draft, 3, 4, {"draft_quantize": "int8" if fmt == "gguf" else fmt}),
             ("ragged", draft, "auto", 3, {}),
             ("exspec", draft, 2, 2, {}), ("ragged", "suffix", "auto", 4, {}), ("eqspec", "ngram", 4, 3, {})]
    for method, drafter, k, batch, extra in cases:
        llm = LLM(target, drafter, method=method, num_speculative_tokens=k, batch_size=batch,
                  window_size=max(batch, 4), **kwargs, **extra)
        outs = llm.generate(prompt_token_ids=ids, sampling_params=PARAMS)
        assert [o.token_ids for o in outs] == reference, f"{fmt} {dtype} {method} {drafter} k={k} B={batch}"


def test_quantized_model_is_batch_invariant_bitwise(quantized_pair):
    """A token's logits are the same bits alone and in a batch of rows of other lengths."""
    model = load_model(quantized_pair[0], quantize="int4")
    rows = prompts(4)
    with torch.no_grad():
        alone = [model(torch.tensor([r]), model.new_cache(1, 64), logits="last")[0, -1] for r in rows]
        width = max(map(len, rows))
        batch = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, r in enumerate(rows):
            batch[i, : len(r)] = torch.tensor(r)
        together = model(batch, model.new_cache(len(rows), 64), num_new=[len(r) for r in rows], logits="last")
    for i in range(len(rows)):
        assert torch.equal(together[i, -1], alone[i])


def test_quantized_layers_match_dequantized_float_layers():
    """The int8 head and embedding share one table; the layer equals F.linear on its dequantized weight to
    bfloat16 rounding."""
    w = torch.randn(131, 64)
    rows = QuantRows("int8", (131, 64), "embed")
    rows.add_float(0, w)
    head = rows.module()
    emb = QuantEmbedding(head, torch.float32)
    ids = torch.tensor([[3, 7, 130]])
    assert torch.equal(emb(ids)[0], head.dequantize()[ids[0]])
    x = torch.randn(4, 64)
    deq = head.dequantize()
    assert ((head(x) - F.linear(x, deq)).abs() <= bf16_tolerance(x, deq)).all()


@pytest.mark.parametrize("source,fmt", [("safetensors", "int8"), ("safetensors", "int4"), ("Q4_1", "int4"),
                                        ("Q4_1", "int8"), ("F16", "int4")])
def test_a_quantized_target_is_recognised_by_the_weights_it_was_loaded_from(tmp_path, source, fmt):
    """Issue 44: `--quantize` must not change which shipped draft a target gets. The quantized numbers differ
    from the file's (the embedding re-quantized int8, Q4 scales rounded to bfloat16, floats quantized), so the
    fingerprint is of the file's weights, sampled as the loader reads them."""
    from specdec.models.feature_draft import fingerprint

    if source == "safetensors":
        path = make_pair("llama", tmp_path)[0]
    else:
        hf = build_hf_model("llama", seed=1, hidden_size=64, intermediate_size=96)
        path = tmp_path / f"llama-{source}.gguf"
        write_gguf(path, hf.config, hf.state_dict(), qtype=gguf.GGMLQuantizationType[source])
    floats, quantized = load_model(path, dtype="float32"), load_model(path, quantize=fmt)
    assert quantized.quantize == fmt
    assert fingerprint(quantized) == fingerprint(floats)
    del quantized.fingerprint_samples  # what the quantized numbers alone give
    if source in ("safetensors", "F16"):  # floats quantized: another model (the bug)
        assert fingerprint(quantized) != fingerprint(floats)
    else:  # a GGUF's blocks are taken as stored on the CPU: the file's own numbers, the same model
        assert fingerprint(quantized) == fingerprint(floats)
