"""Feature drafts (models/feature_draft.py): a draft that reads the target's hidden states keeps every method
exact, greedy and seeded, with the invariant checks on (the draft's K/V recomputed from the stored target
features: a draft cache fed with its own features, or features at the wrong position, fails I4); the features
the runtime stores are the target's own; the saved format round-trips and refuses a draft of another target."""
import json

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine import Engine
from specdec.models import CheckpointError, load_model
from specdec.models.feature_draft import (FeatureDraft, fingerprint, is_feature_draft, layer_config,
                                          load_feature_draft, save_feature_draft)
from test_equivalence import mixed_prompts

PARAMS = SamplingParams(max_tokens=40)


def make_feature_draft(target, seed=0, noise=0.02, feature_weight=0.002, skip_every=7) -> FeatureDraft:
    """A feature draft that agrees with `target` often but not always: the target's layers, perturbed, on
    fc([e, f]) = e + feature_weight * f (so features matter to every K/V), with a draft vocabulary that
    leaves out every `skip_every`-th id (the reduced-vocabulary path)."""
    V = target.vocab_size
    vocab = torch.tensor([i for i in range(V) if i % skip_every], dtype=torch.int64)
    draft = FeatureDraft(layer_config(target.cfg, target.cfg.num_layers), target, vocab)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mine, theirs in zip(draft.layers, target.layers):
            for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
                p.copy_(q + noise * q.std() * torch.randn(q.shape, generator=g, dtype=q.dtype))
        E = target.cfg.hidden_size
        eye = torch.eye(E, dtype=target.dtype)
        draft.fc.weight.copy_(torch.cat([eye, feature_weight * eye], dim=1))  # [E, 2E]
        draft.fc.bias.zero_()
    return draft.eval()


@pytest.fixture(scope="module")
def models(llama_pair):
    target = load_model(llama_pair[0], dtype="float64")
    return target, make_feature_draft(target)


@pytest.fixture(scope="module")
def reference(models):
    target, _ = models
    prompts = mixed_prompts(n=12)
    outs = LLM(target, method="ar", batch_size=4).generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    return prompts, [o.token_ids for o in outs]


@pytest.mark.parametrize("method,k,batch_size", [
    ("eqspec", 3, 4), ("ragged", 4, 3), ("exspec", 2, 4), ("ragged", "auto", 4), ("eqspec", "auto", 3),
    ("exspec", "auto", 2)])
def test_greedy_equals_ar(models, reference, method, k, batch_size):
    target, draft = models
    prompts, expected = reference
    llm = LLM(target, draft, method=method, num_speculative_tokens=k, batch_size=batch_size, check_invariants=True,
              window_size=max(batch_size, 6))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == expected
    if k != "auto":  # partial acceptance: both the accepted and the rejected paths ran
        assert 0.2 < outs.metrics.acceptance_rate < 0.95, outs.metrics.acceptance_rate


def test_seeded_sampling_equals_ar(models, reference):
    target, draft = models
    prompts, _ = reference
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=100 + i) for i in range(len(prompts))]
    ar = LLM(target, method="ar", batch_size=4).generate(prompt_token_ids=prompts, sampling_params=params)
    spec = LLM(target, draft, method="ragged", num_speculative_tokens=3, batch_size=4,
               check_invariants=True).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ar]


def test_unseeded_sampling_runs_with_invariants(models, reference):
    target, draft = models
    prompts, _ = reference
    outs = LLM(target, draft, method="eqspec", num_speculative_tokens=3, batch_size=4, check_invariants=True).generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=20, temperature=1.0))
    assert all(len(o.token_ids) == 20 or o.finish_reason == "stop" for o in outs)
    assert outs.metrics.accepted_drafts > 0


def test_stored_features_are_the_targets_hidden_states(models, reference):
    """After steps that admitted, accepted and rejected, features[i, p] equals a fresh target forward's
    last-layer output at p, for every p below the row's last token."""
    target, draft = models
    prompts, _ = reference
    llm = LLM(target, draft, method="ragged", num_speculative_tokens=3, batch_size=3)
    engine = Engine(llm, 3)
    for p in prompts[:5]:
        engine.add_request(p, SamplingParams(max_tokens=30))
    for _ in range(6):
        engine.step()
    batch = engine.scheduler.batch
    for i, request in enumerate(batch.requests):
        seq = request.prompt_ids + request.output_ids
        cache = target.new_cache(1, len(seq))
        _, hidden = target.forward(torch.tensor([seq[:-1]]), cache, hidden="all")  # [1, n - 1, E]
        torch.testing.assert_close(batch.features[i, : len(seq) - 1], hidden[0], rtol=1e-9, atol=1e-9)


def test_draft_vocabulary_is_never_left(models):
    target, draft = models
    cache = draft.new_cache(2, 8)
    logits = draft.forward(torch.tensor([[5, 9, 11], [3, 4, 7]]), cache)  # [2, 3, V]
    assert torch.isfinite(logits).all()
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[draft.draft_vocab] = False
    assert not outside[logits.argmax(-1)].any()
    assert (logits[..., outside] == torch.finfo(logits.dtype).min).all()


def test_built_through_the_transformer_constructor(models, monkeypatch):
    """FeatureDraft runs Transformer.__init__: every field a Transformer sets (the runtime state: compiled
    forward, numerics modes, RoPE table, ...) a draft has, with the same initial value; its own modules are
    fc, the layers and the head, the target's embedding and norm stay borrowed (not in its state)."""
    target, _ = models
    from specdec.models.transformer import Transformer

    calls = []
    init = Transformer.__init__
    def spy(self, *args, **kwargs):
        calls.append(type(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "__init__", spy)
    draft = make_feature_draft(target)
    assert calls == [FeatureDraft]
    with torch.device("meta"):
        plain = Transformer(draft.cfg, fused=True)
    own = set(vars(plain)) - set(vars(torch.nn.Module()))  # what Transformer.__init__ itself sets
    assert {"cfg", "_compiled_forward", "_batch_invariant", "_rope_table", "head_kernel", "_run_step"} <= own

    def chosen(value):  # a kernel (a partial bound to its model's layer) or a bound method: what it runs
        return getattr(value, "func", getattr(value, "__func__", value))

    for name in own - {"cfg"}:
        assert name in vars(draft), f"FeatureDraft lacks Transformer's {name}"
        if name == "native_reason":  # describes the model (a draft on the CPU, the plain model on meta)
            assert vars(draft)[name] and vars(plain)[name]
            continue
        assert chosen(vars(draft)[name]) == chosen(vars(plain)[name]), name
    assert list(dict(draft.named_children())) == ["fc", "layers", "lm_head"]
    assert draft.embed_tokens is target.embed_tokens and draft.norm is target.norm
    assert not any(k.startswith(("embed_tokens.", "norm.")) for k in draft.state_dict())
    cos, _ = draft.rope_table(8)  # the RoPE table, in the draft's dtype
    assert cos.dtype == target.dtype and cos.shape[0] >= 8


def test_save_load_round_trip_and_wrong_target(models, tmp_path, checkpoint_pairs, llama_pair):
    target, draft = models
    save_feature_draft(draft, tmp_path / "fd", target)
    assert is_feature_draft(tmp_path / "fd") and not is_feature_draft(tmp_path)
    config = json.loads((tmp_path / "fd" / "config.json").read_text())
    assert config["target_fingerprint"] == fingerprint(target)
    loaded = load_feature_draft(tmp_path / "fd", target)
    x = torch.tensor([[5, 9, 11]])
    feats = torch.randn(1, 3, target.cfg.hidden_size, dtype=target.dtype)
    a = draft.forward(x, draft.new_cache(1, 4), features=feats)
    b = loaded.forward(x, loaded.new_cache(1, 4), features=feats)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # float32 on disk: equal to float32 rounding
    qwen = load_model(checkpoint_pairs("qwen3")[0], dtype="float64")
    if qwen.cfg.hidden_size != target.cfg.hidden_size or qwen.cfg.num_heads != target.cfg.num_heads:
        with pytest.raises(CheckpointError, match="config.json: .* but the target's is"):
            load_feature_draft(tmp_path / "fd", qwen)
    assert fingerprint(qwen) != fingerprint(target)
    # the weights, not the dtype they were loaded in: a bfloat16 run of the same target finds its draft too
    assert fingerprint(load_model(llama_pair[0], dtype="bfloat16")) == fingerprint(target)


def test_shipped_draft_is_used_by_fingerprint(models, llama_pair, tmp_path, monkeypatch, capsys, checkpoint_pairs):
    """A target with a shipped draft (recognised by its weights, whatever its path) gets it when no draft is
    given, with one line on stderr; another target gets the error naming it."""
    import shutil

    from specdec import drafts

    target64, draft64 = models
    target = load_model(llama_pair[0], dtype="float32")
    shipped = tmp_path / "shipped"
    save_feature_draft(make_feature_draft(target), shipped / "tiny-llama", target)
    monkeypatch.setattr(drafts, "SHIPPED", shipped)
    renamed = tmp_path / "renamed-target"
    shutil.copytree(llama_pair[0], renamed)  # a different path, the same weights
    llm = LLM(str(renamed), num_speculative_tokens=3, batch_size=2, check_invariants=True)
    assert isinstance(llm.draft, FeatureDraft) and llm.draft.embed_tokens is llm.target.embed_tokens
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "using the draft shipped for this target (tiny-llama" in err
    outs = llm.generate(prompt_token_ids=mixed_prompts(n=3), sampling_params=SamplingParams(max_tokens=12))
    ar = LLM(str(renamed), method="ar").generate(prompt_token_ids=mixed_prompts(n=3),
                                                 sampling_params=SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    other = checkpoint_pairs("qwen3")[0]  # no draft shipped for it: suffix decoding, said in one line
    capsys.readouterr()
    fallback = LLM(other, method="ragged")
    assert fallback.draft is None and fallback.drafter == "suffix"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"none shipped for target {other}; drafting with 'suffix'" in err


def test_cli_target_without_draft_says_why(checkpoint_pairs, capsys):
    """`--target` alone: the shipped draft when one fits (above), else suffix decoding, said in one line."""
    from specdec.run import main

    target = checkpoint_pairs("qwen3")[0]
    capsys.readouterr()  # building the pair logs progress bars
    main(["--target", target, "--prompt", "hello", "--max-tokens", "2", "--no-progress"])  # (it has no tokenizer)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "drafting with" in line]
    assert len(err) == 1 and f"none shipped for target {target}; drafting with 'suffix'" in err[0]
