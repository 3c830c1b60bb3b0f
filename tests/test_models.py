"""Parity of our Transformer with `transformers` (the oracle) on tiny random checkpoints of each family.

Every test compares what our model computes for a *batch* of prompts of different lengths, in both cache
layouts, against HF run on each prompt alone over its full sequence (HF is causal, so its logits at
position t of the full sequence are the logits of the prefix ending at t).

- Llama: GQA (4 query heads, 2 KV heads), NeoX rotate-half RoPE;
- Qwen3: head_dim 24 != hidden / heads, q/k norms, tied embeddings (no `lm_head.weight` in the file);
- GLM-4: partial (half) interleaved RoPE, q/k/v biases, fused gate_up, post-attention / post-MLP norms.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from checkpoints import FAMILIES, build_hf_model, save_checkpoint
from safetensors import safe_open

from specdec.models.cache import LEFT_PADDED, RAGGED
from specdec.models import ModelConfig, Transformer, load_model

TOL = 1e-4  # max abs logit difference vs HF, float32
LAYOUTS = (LEFT_PADDED, RAGGED)
PROMPT_LENGTHS = (7, 3, 1, 5)
GREEDY_NEW = 32


# --------------------------------------------------------------------------- helpers


def random_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def prefill(model: Transformer, prompts, layout: str, capacity: int = 64, logits: str = "all"):
    """Batched prefill. Returns (cache, out [B, W, V] or [B, 1, V], width W)."""
    B, W = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, W, dtype=torch.long)  # [B, W], pad id 0
    for i, p in enumerate(prompts):
        if layout == LEFT_PADDED:
            ids[i, W - len(p):] = torch.tensor(p)
        else:
            ids[i, : len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])  # [B]
    cache = model.new_cache(B, capacity, layout)
    cache.set_prefill(lens, W)
    out = model(ids, cache, num_new=lens, logits=logits)
    return cache, out, W


def real_rows(out, prompts, layout: str, W: int) -> list[torch.Tensor]:
    """The logits of the real (non-padding) positions of each row of a prefill output [B, W, V]."""
    return [out[i, W - len(p):] if layout == LEFT_PADDED else out[i, : len(p)] for i, p in enumerate(prompts)]


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """HF logits [N, V] of one sequence run alone (no padding, no cache)."""
    return hf(torch.tensor([tokens])).logits[0]


def max_err_vs_hf(hf, seqs, ours) -> float:
    """Max over rows of |HF(full sequence) - ours| over every position we computed for that row."""
    errs = []
    for seq, mine in zip(seqs, ours):
        ref = hf_logits(hf, seq)
        assert mine.shape == ref.shape, (mine.shape, ref.shape)
        errs.append((ref.float() - mine.float()).abs().max().item())
    return max(errs)


def run_steps(model, prompts, layout: str, seed: int = 1, ragged_partial: bool = True):
    """Prefill, then steps of 1, 1, 6, 6 tokens per row (and in the ragged layout a step of 6 slots with
    1..6 real tokens per row, then one more token). Returns (sequences, our logits per row [N, V])."""
    vocab = model.vocab_size
    g = torch.Generator().manual_seed(seed)
    cache, out, W = prefill(model, prompts, layout)
    seqs = [list(p) for p in prompts]
    ours = [list(r) for r in real_rows(out, prompts, layout, W)]
    B = len(prompts)
    for T in (1, 1, 6, 6):
        new = torch.randint(3, vocab, (B, T), generator=g)  # [B, T]
        out = model(new, cache)  # [B, T, V]
        assert out.shape == (B, T, vocab)
        for i in range(B):
            seqs[i] += new[i].tolist()
            ours[i] += list(out[i])
    if layout == RAGGED and ragged_partial:
        num_new = torch.tensor([6, 1, 3, 2][:B])  # a verify-like step: row i keeps num_new[i] of 6 slots
        new = torch.randint(3, vocab, (B, 6), generator=g)
        out = model(new, cache, num_new=num_new)
        for i in range(B):
            k = int(num_new[i])
            seqs[i] += new[i, :k].tolist()
            ours[i] += list(out[i, :k])
        new = torch.randint(3, vocab, (B, 1), generator=g)
        out = model(new, cache)
        for i in range(B):
            seqs[i] += new[i].tolist()
            ours[i] += list(out[i])
    assert cache.length.tolist() == [len(s) for s in seqs]
    return seqs, [torch.stack(r) for r in ours]


def edit_config(src: str, dst: str, edit) -> str:
    """Copy checkpoint `src` to `dst` and apply `edit(dict)` to its config.json by hand."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        raw = json.load(f)
    edit(raw)
    with open(path, "w") as f:
        json.dump(raw, f, indent=2)
    return dst


@torch.no_grad()
def logits_of(model, prompts, layout=RAGGED) -> torch.Tensor:
    """Prefill + one 6-token step; all real logits of all rows concatenated [sum N, V]."""
    seqs, ours = run_steps(model, prompts, layout, ragged_partial=False)
    return torch.cat(ours)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def family_ckpt(tmp_path_factory):
    """family -> (hf float32 model, checkpoint dir, our float32 model); each built once."""
    built = {}

    def get(family):
        if family not in built:
            hf = build_hf_model(family, seed=1)
            d = save_checkpoint(hf, tmp_path_factory.mktemp(family))
            built[family] = (hf, d, load_model(d, dtype="float32"))
        return built[family]

    return get


@pytest.fixture(scope="module")
def hf_greedy(family_ckpt):
    """family -> HF float64 `generate` (greedy) continuation of each prompt, run one prompt at a time."""
    done = {}

    def get(family):
        if family not in done:
            hf, d, _ = family_ckpt(family)
            hf64 = type(hf).from_pretrained(d, dtype=torch.float64).eval()
            conts = []
            for p in random_prompts(hf.config.vocab_size, seed=2):
                out = hf64.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    do_sample=False, max_new_tokens=GREEDY_NEW, eos_token_id=None,
                                    pad_token_id=0)
                assert out.shape[1] == len(p) + GREEDY_NEW  # eos did not stop it early
                conts.append(out[0, len(p):].tolist())
            done[family] = (conts, load_model(d, dtype="float64"))
        return done[family]

    return get


@pytest.fixture(scope="module")
def llama_variants(tmp_path_factory):
    """Llama checkpoints with config variants; name -> (hf model or None, dir)."""
    root = tmp_path_factory.mktemp("llama_variants")
    out = {}
    hf = build_hf_model("llama", seed=3, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    out["linear"] = (hf, save_checkpoint(hf, root / "linear"))
    out["linear_legacy"] = (hf, edit_config(out["linear"][1], str(root / "linear_legacy"), lambda raw: (
        raw.pop("rope_parameters"), raw.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0}))))
    hf = build_hf_model("llama", seed=4, num_key_value_heads=4)  # MHA: kv heads == heads
    out["mha"] = (hf, save_checkpoint(hf, root / "mha"))
    out["mha_absent"] = (hf, edit_config(out["mha"][1], str(root / "mha_absent"),
                                         lambda raw: raw.pop("num_key_value_heads")))
    hf = build_hf_model("llama", seed=5, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    out["theta_nested"] = (hf, save_checkpoint(hf, root / "theta_nested"))
    out["theta_top"] = (hf, edit_config(out["theta_nested"][1], str(root / "theta_top"), lambda raw: (
        raw.pop("rope_parameters"), raw.update(rope_theta=500.0))))
    out["theta_absent"] = (hf, edit_config(out["theta_nested"][1], str(root / "theta_absent"),
                                           lambda raw: raw.pop("rope_parameters")))
    return out


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_parity_prefill_and_steps(family_ckpt, family, layout):
    """Prefill of prompts of lengths 7/3/1/5, then steps of 1 and 6 tokens: every logit within 1e-4 of HF."""
    hf, _, model = family_ckpt(family)
    prompts = random_prompts(model.vocab_size)
    seqs, ours = run_steps(model, prompts, layout)
    assert max_err_vs_hf(hf, seqs, ours) <= TOL


def test_family_features_are_detected(family_ckpt):
    """The config flags that make the three families differ, and Qwen3's tie without lm_head in the file."""
    llama, qwen3, glm4 = (family_ckpt(f)[2] for f in FAMILIES)
    assert llama.cfg.num_kv_heads * 2 == llama.cfg.num_heads  # GQA
    assert not llama.cfg.rope_interleaved and llama.cfg.rotary_dim == llama.cfg.head_dim
    assert qwen3.cfg.head_dim == 24 != qwen3.cfg.hidden_size // qwen3.cfg.num_heads and qwen3.cfg.qk_norm
    with safe_open(os.path.join(family_ckpt("qwen3")[1], "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert qwen3.lm_head.weight is qwen3.embed_tokens.weight
    assert glm4.cfg.rope_interleaved and glm4.cfg.rotary_dim == glm4.cfg.head_dim // 2
    assert glm4.cfg.attention_bias and glm4.cfg.sandwich_norms and glm4.cfg.fused_gate_up
    assert glm4.layers[0].self_attn.qkv_proj.bias is not None and glm4.layers[0].self_attn.o_proj.bias is None
    unfused = load_model(family_ckpt("glm4")[1], fuse=False)
    assert unfused.layers[0].self_attn.q_proj.bias is not None


def test_fused_projections_compute_the_same(family_ckpt):
    """load_model fuses q/k/v and gate/up after loading: the logits are those of the unfused model."""
    for family in FAMILIES:
        path = family_ckpt(family)[1]
        fused, plain = load_model(path, dtype="float64"), load_model(path, dtype="float64", fuse=False)
        ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
        a = fused(ids, fused.new_cache(2, 8, RAGGED))
        b = plain(ids, plain.new_cache(2, 8, RAGGED))
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_last_is_last_real_position(family_ckpt, family, layout):
    _, _, model = family_ckpt(family)
    prompts = random_prompts(model.vocab_size, seed=3)
    B = len(prompts)
    cache_all, out_all, W = prefill(model, prompts, layout)
    cache_last, out_last, _ = prefill(model, prompts, layout, logits="last")
    assert out_last.shape == (B, 1, model.vocab_size)
    for i, row in enumerate(real_rows(out_all, prompts, layout, W)):
        torch.testing.assert_close(out_last[i, 0], row[-1], rtol=0, atol=1e-5)
    assert torch.equal(cache_all.length, cache_last.length)

    new = torch.randint(3, model.vocab_size, (B, 6), generator=torch.Generator().manual_seed(4))
    full = model(new, cache_all)
    last = model(new, cache_last, logits="last")
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=0, atol=1e-5)

    if layout == RAGGED:  # fewer real tokens than slots: the last *real* one, not slot T-1
        num_new = torch.tensor([2, 6, 1, 4])
        new = torch.randint(3, model.vocab_size, (B, 6), generator=torch.Generator().manual_seed(5))
        full = model(new, cache_all, num_new=num_new)
        last = model(new, cache_last, num_new=num_new, logits="last")
        for i in range(B):
            torch.testing.assert_close(last[i, 0], full[i, int(num_new[i]) - 1], rtol=0, atol=1e-5)
        assert torch.equal(cache_all.length, cache_last.length)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate_float64(hf_greedy, family, layout):
    """32 greedy tokens, our batched model driven one token per step, == HF `generate` per prompt (float64)."""
    expected, model = hf_greedy(family)
    assert model.dtype == torch.float64
    prompts = random_prompts(model.vocab_size, seed=2)
    B = len(prompts)
    cache, out, _ = prefill(model, prompts, layout, capacity=max(map(len, prompts)) + GREEDY_NEW, logits="last")
    got = [[] for _ in range(B)]
    for step in range(GREEDY_NEW):
        nxt = out[:, -1].argmax(-1)  # [B]
        for i in range(B):
            got[i].append(int(nxt[i]))
        if step < GREEDY_NEW - 1:
            out = model(nxt[:, None], cache, logits="last")  # [B, 1, V]
    assert got == expected


# --------------------------------------------------------------------------- config variants


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_linear_rope_scaling(llama_variants, layout):
    hf, d = llama_variants["linear"]
    model = load_model(d)
    assert model.cfg.rope_linear_factor == 2.0
    prompts = random_prompts(model.vocab_size, seed=6)
    seqs, ours = run_steps(model, prompts, layout)
    assert max_err_vs_hf(hf, seqs, ours) <= TOL


def test_llama_linear_rope_scaling_legacy_key(llama_variants):
    """Old-style `rope_scaling: {type: linear}` + top-level `rope_theta` loads as the new-style config."""
    prompts = random_prompts(131, seed=7)
    new = load_model(llama_variants["linear"][1])
    legacy = load_model(llama_variants["linear_legacy"][1])
    assert legacy.cfg == new.cfg
    assert torch.equal(logits_of(legacy, prompts), logits_of(new, prompts))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_mha(llama_variants, layout):
    hf, d = llama_variants["mha"]
    model = load_model(d)
    assert model.cfg.num_kv_heads == model.cfg.num_heads == 4
    prompts = random_prompts(model.vocab_size, seed=8)
    seqs, ours = run_steps(model, prompts, layout)
    assert max_err_vs_hf(hf, seqs, ours) <= TOL


def test_llama_mha_kv_heads_absent(llama_variants):
    """`num_key_value_heads` missing from config.json means MHA: same logits as when it equals the heads."""
    with open(os.path.join(llama_variants["mha_absent"][1], "config.json")) as f:
        assert "num_key_value_heads" not in json.load(f)
    absent = load_model(llama_variants["mha_absent"][1])
    equal = load_model(llama_variants["mha"][1])
    assert absent.cfg.num_kv_heads == 4
    prompts = random_prompts(131, seed=9)
    assert torch.equal(logits_of(absent, prompts), logits_of(equal, prompts))


def test_rope_theta_top_level_or_nested(llama_variants):
    """rope_theta 500 at top level == inside rope_parameters (== HF); dropping it (default 10000) differs."""
    hf, nested_dir = llama_variants["theta_nested"]
    nested, top = load_model(nested_dir), load_model(llama_variants["theta_top"][1])
    absent = load_model(llama_variants["theta_absent"][1])
    assert nested.cfg.rope_theta == top.cfg.rope_theta == 500.0 and absent.cfg.rope_theta == 10000.0
    prompts = random_prompts(131, seed=10)
    ref = logits_of(nested, prompts)
    assert torch.equal(logits_of(top, prompts), ref)
    assert (logits_of(absent, prompts) - ref).abs().max() > 1e-2  # the test can see a wrong theta
    seqs, ours = run_steps(nested, prompts, LEFT_PADDED)
    assert max_err_vs_hf(hf, seqs, ours) <= TOL


def rope_lookup(model, positions, count):
    """cos, sin [B, 1, T, R] of positions [B, T] (all below `count`) looked up in the model's table."""
    cos, sin = model.rope_table(count)  # [N, R] each
    return cos[positions][:, None], sin[positions][:, None]


def rope_per_forward(model, positions):
    """cos, sin [B, 1, T, R] as the forward computed them before the table: float32 angles of these positions."""
    freqs = positions[..., None].float() * model.inv_freq(positions.device)  # [B, T, R/2] float32
    emb = freqs.repeat_interleave(2, dim=-1) if model.cfg.rope_interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(model.dtype)[:, None], emb.sin().to(model.dtype)[:, None]


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rope_table_equals_the_per_forward_angles(family_ckpt, family, dtype):
    """The table's cos/sin are the bits the per-forward formula gives, at any position, before and after the
    table grows (Llama/Qwen3 rotate halves, GLM-4 interleaved pairs of half the head)."""
    model = load_model(family_ckpt(family)[1], dtype=dtype)
    positions = torch.randint(0, 5000, (3, 17), generator=torch.Generator().manual_seed(0))  # [B, T]
    for count in (64, 5000, 20000):  # positions beyond a short table: the table grows
        small = positions % count
        for got, want in zip(rope_lookup(model, small, count), rope_per_forward(model, small)):
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert model.rope_table(1)[0].shape[0] >= 20000


def test_rope_table_is_computed_once_per_model(family_ckpt, monkeypatch):
    """Prefill and steps compute the RoPE angles once (they look positions up); a larger cache grows the table
    once; another dtype recomputes it."""
    _, d, _ = family_ckpt("llama")
    model = load_model(d)
    calls = []
    inv_freq = model.inv_freq
    monkeypatch.setattr(model, "inv_freq", lambda device: calls.append(device) or inv_freq(device))
    prompts = random_prompts(model.vocab_size, seed=13)
    run_steps(model, prompts, RAGGED)
    run_steps(model, prompts, LEFT_PADDED)
    assert len(calls) == 1
    prefill(model, prompts, RAGGED, capacity=64 * 3)
    prefill(model, prompts, RAGGED, capacity=64 * 2)
    assert len(calls) == 2 and model.rope_table(1)[0].shape[0] == 64 * 3
    model.to(torch.float64)
    ref = logits_of(load_model(d, dtype="float64"), prompts)
    assert torch.equal(logits_of(model, prompts), ref) and len(calls) == 3


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_loads_same_logits(family_ckpt, tmp_path, family):
    hf, single_dir, single = family_ckpt(family)
    sharded_dir = save_checkpoint(hf, tmp_path / "sharded", max_shard_size="20KB")
    files = os.listdir(sharded_dir)
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    sharded = load_model(sharded_dir)
    prompts = random_prompts(single.vocab_size, seed=11)
    assert torch.equal(logits_of(sharded, prompts), logits_of(single, prompts))
    if family == "qwen3":
        assert sharded.lm_head.weight is sharded.embed_tokens.weight


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_load_dtypes(family_ckpt, family, dtype):
    """Every weight and the cache in the requested dtype; logits close to float32 (loosely for 16-bit)."""
    _, d, ref_model = family_ckpt(family)
    model = load_model(d, dtype=dtype)
    want = getattr(torch, dtype)
    assert model.dtype == want
    assert all(p.dtype == want for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.new_cache(1, 8).k.dtype == want
    prompts = random_prompts(model.vocab_size, seed=12)
    got = logits_of(model, prompts)
    assert got.dtype == want and torch.isfinite(got).all()
    ref = logits_of(ref_model, prompts)
    scale = ref.abs().max().item()
    tol = {"float64": 1e-4, "float32": 0.0, "bfloat16": 0.1 * scale, "float16": 0.02 * scale}[dtype]
    assert (got.double() - ref.double()).abs().max().item() <= tol


def test_load_dtype_argument_forms(family_ckpt):
    d = family_ckpt("llama")[1]
    assert load_model(d, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="int8"):
        load_model(d, dtype="int8")


def test_config_from_dir_matches_hf(family_ckpt):
    for family in FAMILIES:
        hf, d, _ = family_ckpt(family)
        cfg = ModelConfig.from_dir(d)
        assert cfg.family == family
        assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
            hf.config.vocab_size, hf.config.hidden_size, hf.config.num_hidden_layers,
            hf.config.num_attention_heads, hf.config.num_key_value_heads)
        assert cfg.rms_norm_eps == hf.config.rms_norm_eps
        assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
