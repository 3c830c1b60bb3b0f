"""The lean forward (models/transformer.py, issue 41): few ops a layer, each fused op computing HF's bits.

The count is held per layer: the ops of a one-token step of a 3-layer model minus those of a 1-layer model,
halved (what a layer costs, whatever a forward costs once), and, on the real SmolLM2 GGUF, the whole step
over its 30 layers -- both at most 20 (64 before the lean forward, 111 with int4 weights)."""
import pytest
import torch
import torch.nn.functional as F

from bench.op_count import step_ops
from checkpoints import make_checkpoint
from specdec.models import load_model, numerics
from specdec.models.cache import LEFT_PADDED, RAGGED

OPS_PER_LAYER = 20


@pytest.fixture(scope="module")
def family_ckpts(tmp_path_factory):
    built = {}

    def get(family, layers):
        if (family, layers) not in built:
            built[family, layers] = make_checkpoint(family, tmp_path_factory.mktemp(f"lean-{family}-{layers}"),
                                                    num_hidden_layers=layers)
        return built[family, layers]

    return get


def per_layer(family_ckpts, family, dtype="float32", packed=False, rows=1, tokens=1, quantize=None):
    """(ops a layer adds, ops a forward costs once)."""
    counts = []
    for layers in (1, 3):
        model = load_model(family_ckpts(family, layers), dtype=dtype, quantize=quantize)
        model.packed_linear = packed
        counts.append(sum(step_ops(model, rows, tokens).values()))
    layer = (counts[1] - counts[0]) / 2
    return layer, counts[0] - layer


@pytest.mark.parametrize("packed", [False, True])
def test_a_decode_step_runs_at_most_20_ops_a_layer(family_ckpts, packed):
    if packed and numerics.pack_weight(torch.zeros(8, 8)) is None:
        pytest.skip("torch without oneDNN's packed linear on this CPU")
    layer, once = per_layer(family_ckpts, "llama", packed=packed)
    assert layer <= (17 if packed else 19), f"{layer} ops a layer"  # what the layer is written as today
    assert once <= 40, f"{once} ops a forward besides its layers"
    for tokens, rows in ((4, 1), (1, 3), (4, 3)):  # a verify, a batch of rows of one length, both
        assert per_layer(family_ckpts, "llama", packed=packed, rows=rows, tokens=tokens)[0] <= OPS_PER_LAYER


def test_the_other_families_stay_lean(family_ckpts):
    """Qwen3's per-head q/k norms and GLM-4's extra norms and biases cost a few ops more, no more."""
    assert per_layer(family_ckpts, "qwen3")[0] <= OPS_PER_LAYER + 6
    assert per_layer(family_ckpts, "glm4")[0] <= OPS_PER_LAYER + 6


def test_rms_norm_in_one_op_has_the_chains_bits():
    """float32 `F.rms_norm` == HF's chain (normalise in float32, cast back, scale), bit for bit, at many shapes;
    other dtypes run the chain's order (bfloat16 would differ: the weight multiplies after the cast)."""
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 576), (7, 576), (3, 5, 64), (130, 4096), (2, 3, 9, 128)):
        x = torch.randn(shape, generator=g) * 3
        w = torch.randn(shape[-1], generator=g)
        chain = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(numerics.rms_norm_kernel(False, torch.float32)(x, w, 1e-5), chain), shape
        xb, wb = x.bfloat16(), w.bfloat16()
        x32 = xb.float()
        chain = wb * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
        assert torch.equal(numerics.rms_norm_kernel(False, torch.bfloat16)(xb, wb, 1e-5), chain), shape


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


@pytest.mark.parametrize("family", ["llama", "qwen3", "glm4"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_one_rotation_formula_gives_hf_s_bits(family_ckpts, family, dtype):
    """`numerics.rotate` with `rope_heads`' tables == HF's `x * cos + rotate_half(x) * sin` on q and k (halves or
    GLM-4's interleaved pairs of half the head, the rest passed through), and V untouched, bit for bit."""
    model = load_model(family_ckpts(family, 1), dtype=dtype)
    cfg = model.cfg
    H, Hkv, D, R = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 300, (2, 5), generator=g)  # [B, T]
    x = (torch.randn(2, 5, H + 2 * Hkv, D, generator=g) * 2).to(model.dtype)  # [B, T, heads, D]
    got = numerics.rotate(x, *model.rope_heads(positions))
    cos, sin = model.rope_table(300)  # [N, R] each, positions 0..N-1
    cos, sin = cos[positions][:, :, None], sin[positions][:, :, None]  # [B, T, 1, R]
    qk = x[:, :, :H + Hkv]
    rot = rotate_pairs(qk[..., :R]) if cfg.rope_interleaved else rotate_half(qk[..., :R])
    want = torch.cat((qk[..., :R] * cos + rot * sin, qk[..., R:]), dim=-1)
    assert torch.equal(got[:, :, :H + Hkv], want)
    assert torch.equal(got[:, :, H + Hkv:], x[:, :, H + Hkv:])


@pytest.mark.parametrize("layout", [RAGGED, LEFT_PADDED])
def test_the_forward_writes_k_and_v_in_one_op_where_the_plan_says(family_ckpts, layout, monkeypatch):
    """One `kv_append` a layer, at the plan's columns, with K and V of the tokens (layer 0 recomputed)."""
    model = load_model(family_ckpts("llama", 3), dtype="float64")
    import specdec.models.transformer as transformer

    calls, real = [], transformer.kv_append
    monkeypatch.setattr(transformer, "kv_append", lambda *a, **kw: calls.append(a[2].clone()) or real(*a, **kw))
    cache = model.new_cache(2, 16, layout)
    cache.set_prefill([4, 2], 4)
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10] if layout == LEFT_PADDED else [9, 10, 0, 0]])
    model.forward(ids, cache, num_new=[4, 2])
    model.forward(torch.tensor([[11], [12]]), cache)
    assert len(calls) == 2 * model.cfg.num_layers
    rows = [[5, 6, 7, 8, 11], [9, 10, 12]]
    for i, tokens in enumerate(rows):
        k, v = model.layer0_kv(torch.tensor([tokens]), torch.arange(len(tokens))[None])  # [1, H_kv, n, D]
        s = cache.host_start[i]
        torch.testing.assert_close(cache.k[0, i, :, s:s + len(tokens)], k[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(cache.v[0, i, :, s:s + len(tokens)], v[0], rtol=0, atol=1e-12)


@pytest.mark.real_model
def test_the_real_model_s_decode_step_is_lean():
    """SmolLM2-135M (Q4_1 GGUF) as `LLM` loads it on the CPU (float32, packed weights) and unpacked: at most
    20 ops a layer over the whole one-token step (today 17.9 and 19.8; 64 before)."""
    from real_model import real_gguf

    model = load_model(real_gguf(), dtype="float32")
    for packed in (True, False):
        model.packed_linear = packed and numerics.packing_pays(model)
        ops = sum(step_ops(model).values())
        assert ops / model.cfg.num_layers <= OPS_PER_LAYER, (packed, ops)
