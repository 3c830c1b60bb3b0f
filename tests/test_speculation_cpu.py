"""Speculation that pays on a CPU (issue 56): a draft whose head is restricted to a subset of the vocabulary
(models/transformer.py `restrict_head`, specdec/draft_vocab.py), drafts that stop when unsure
(specdec/proposers/model.py, `KChooser.stop_threshold`), and free drafts first (a lookup's drafts, the model
not running where every row has them: specdec/proposers/combined.py). Each keeps the output exact: greedy equals
AR, seeded equals AR's seeded sample, and unseeded sampling keeps the target's distribution."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from block_models import block_model
from choosers import linear_costs
from specdec import LLM, SamplingParams
from specdec.autok import KChooser
from specdec.kernels import qmm_cpu
from test_sampling import exact_marginal, small_vocab_pair, total_variation  # noqa: F401 (a fixture)

VOCAB = 300


# ------------------------------------------------------------------------------------------ the restricted head
@pytest.mark.parametrize("native", [True, False])
def test_a_restricted_head_gives_the_full_heads_logits_on_its_subset_and_minus_inf_elsewhere(native):
    model = block_model("qwen2", seed=3)
    if not native:
        model.native_forward = False
    ids = torch.tensor([[5, 17, 3, 99, 42, 7]])
    full = model(ids, model.new_cache(1, 8))  # [1, 6, V]
    subset = torch.tensor(sorted({2, 5, 9, *range(20, 300, 7)}))
    model.restrict_head(subset)
    assert (model.native is not None) == native
    got = model(ids, model.new_cache(1, 8))
    assert got.shape == full.shape
    assert torch.equal(got[..., subset], full[..., subset])  # the same blocks: the same numbers
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[subset] = False
    assert torch.isneginf(got[..., outside]).all() and torch.isfinite(got[..., subset]).all()
    with pytest.raises(ValueError, match="already restricted"):
        model.restrict_head(subset)


def test_a_float_heads_restriction_is_its_rows():
    from checkpoints import build_hf_model
    from specdec.models.config import ModelConfig
    from specdec.models.transformer import Transformer

    hf = build_hf_model("llama", seed=0)
    model = Transformer(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()}, strict=False)
    ids = torch.tensor([[5, 17, 3]])
    full = model(ids, model.new_cache(1, 4))
    subset = torch.arange(0, 131, 2)
    model.restrict_head(subset)
    got = model(ids, model.new_cache(1, 4))
    assert torch.allclose(got[..., subset], full[..., subset]) and torch.isneginf(got[..., 1::2]).all()


def test_the_shipped_count_gives_a_subset_with_the_special_tokens():
    from specdec import draft_vocab

    tokenizer = SimpleNamespace(fingerprint=lambda: "0" * 64, eos_token_ids={151645, 151643}, bos_token_id=None,
                                pad_token_id=None)
    assert draft_vocab.subset(tokenizer, 100, 151936) is None  # no table for this fingerprint
    tables = sorted(draft_vocab.ASSETS.glob("*.npz"))
    if not tables:
        pytest.skip("no token count ships")
    tokenizer.fingerprint = lambda: tables[0].stem + "0" * 48
    chosen = draft_vocab.subset(tokenizer, 1000, 151936)
    assert chosen is not None and 1000 <= len(chosen) <= 1002 and {151645, 151643} <= set(chosen.tolist())
    assert (np.diff(chosen) > 0).all()
    assert draft_vocab.subset(tokenizer, 151936, 151936) is None  # the whole vocabulary: no restriction


# ------------------------------------------------------------------------------------------ exact outputs
def pair():
    """A native target; a draft that agrees with it often (its own copy, head restricted to 2/3 of the
    vocabulary: the target's tokens outside are never drafted)."""
    target = block_model("llama", seed=11)
    draft = copy.deepcopy(target)
    draft.restrict_head(torch.tensor([i for i in range(VOCAB) if i % 3]))
    return target, draft


def workload(temperature: float, n: int = 6):
    g = torch.Generator().manual_seed(9)
    prompts = []
    for i in range(n):
        base = torch.randint(3, VOCAB, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
        prompts.append(base + base[:6] if i % 2 else base)  # planted repeats: a lookup has drafts
    params = [SamplingParams(max_tokens=16, temperature=temperature, top_p=0.95 if temperature else 1.0,
                             seed=70 + i if temperature else None, ignore_eos=True) for i in range(n)]
    return prompts, params


@pytest.mark.skipif(not qmm_cpu.available(), reason="the CPU quantized kernel is not built")
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_every_method_equals_ar_with_a_restricted_draft_that_stops_when_unsure_beside_a_lookup(temperature):
    target, draft = pair()
    prompts, params = workload(temperature)
    common = dict(cost_cache="", check_invariants=True, max_speculative_tokens=5)
    want = [o.token_ids for o in LLM(target, method="ar", batch_size=1, **common).generate(
        prompt_token_ids=prompts, sampling_params=params)]
    stopped = 0
    for method, k, batch, extra in (("eqspec", 5, 3, {"draft_confidence": 0.6}),
                                    ("ragged", 4, 4, {"draft_confidence": 0.6, "lookup": "suffix"}),
                                    ("exspec", 5, 2, {"draft_confidence": 0.8, "window_size": 4}),
                                    ("ragged", "auto", 3, {}), ("eqspec", "auto", 1, {"lookup": "ngram"}),
                                    ("ragged", 5, 2, {"draft_confidence": 0.0, "lookup": None})):
        llm = LLM(target, draft, method=method, num_speculative_tokens=k, batch_size=batch, **common, **extra)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == want, f"{method} k={k} B={batch} {extra}"
        if isinstance(k, int):  # (auto k may rightly stay at k = 0 on models this small)
            assert outs.metrics.accepted_drafts > 0, f"{method}: the restricted draft's drafts were never taken"
        if isinstance(k, int) and extra.get("draft_confidence"):
            stopped += sum(n for width, n in outs.metrics.k_histogram.items() if 0 < width < k)
    assert stopped > 0  # some steps verified fewer drafts than k: rows really stopped when unsure


@pytest.mark.parametrize("seeded", [True, False])
def test_a_restricted_draft_that_stops_when_unsure_keeps_the_target_distribution(small_vocab_pair, seeded):  # noqa: F811
    """Sampled drafts from the renormalised subset distribution, rows stopping when unsure, a lookup beside:
    the emitted tokens' distribution is the target's (exact marginals by enumeration, as test_sampling.py)."""
    from specdec.models import load_model

    target, draft_dir = small_vocab_pair
    draft = load_model(draft_dir, dtype="float64")
    draft.restrict_head(torch.tensor([0, 2, 3, 5, 7, 8, 10, 11]))  # 8 of 12 tokens
    prompt, n = [1, 5, 7], 2000
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s if seeded else None, ignore_eos=True)
              for s in range(n)]
    llm = LLM(target, draft, method="ragged", num_speculative_tokens=3, batch_size=64, dtype="float64",
              cost_cache="", draft_confidence=0.3, lookup="suffix", suffix_store_tokens=0)
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params)
    assert 0.1 < outs.metrics.acceptance_rate < 0.95
    for position in (1, 2):
        exact = exact_marginal(target, prompt, position + 1)
        empirical = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=12).double() / n
        assert total_variation(empirical, exact) < 0.06, f"token {position}"


# ------------------------------------------------------------------------------------------ free drafts first
@pytest.mark.skipif(not qmm_cpu.available(), reason="the CPU quantized kernel is not built")
def test_where_every_row_has_a_lookups_drafts_the_draft_model_does_not_run():
    target, draft = pair()
    base = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    prompts = [base * 4]  # a lookup continues the repetition: free drafts from the first step
    params = [SamplingParams(max_tokens=24, ignore_eos=True)]
    want = LLM(target, method="ar", cost_cache="").generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(target, draft, method="ragged", num_speculative_tokens=4, batch_size=1, lookup="ngram", cost_cache="",
              check_invariants=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert outs[0].token_ids == want[0].token_ids
    m = outs.metrics
    assert m.lookup_rows > 0 and m.draft_forwards < 4 * (m.steps - 1)  # steps the model skipped


def test_a_rows_lookup_is_passed_over_where_it_is_accepted_much_less_than_the_model():
    from specdec.proposers import CombinedProposer, ModelProposer, NgramProposer

    proposer = CombinedProposer(ModelProposer(), NgramProposer(1, 3), min_match=2)
    request = SimpleNamespace(key=("a", 0))
    assert proposer.takes_lookup(request, [5, 6, 7], 2) and not proposer.takes_lookup(request, [5], 2)
    proposer.records[request.key] = {"lookup": [0.5, 10.0], "model": [9.0, 10.0]}
    assert not proposer.takes_lookup(request, [5, 6, 7], 2)  # 5% against 90%: the model drafts this row
    proposer.records[request.key] = {"lookup": [6.0, 10.0], "model": [9.0, 10.0]}
    assert proposer.takes_lookup(request, [5, 6, 7], 2)


# ------------------------------------------------------------------------------------------ the threshold
class Rows:
    def __init__(self, n):
        self.requests = [SimpleNamespace(acceptance=[0.0, 0.0]) for _ in range(n)]

    def __len__(self):
        return len(self.requests)


def test_drafting_stops_where_one_more_draft_no_longer_pays():
    """The threshold is the expected rate times one more draft's cost (a row's share of it): a dearer draft stops
    rows sooner; it never exceeds MAX_STOP_THRESHOLD; a step without drafts has none."""
    cheap, dear = linear_costs(10e-3, 0.1e-3, 1e-3, 0.01e-3), linear_costs(10e-3, 0.1e-3, 5e-3, 0.01e-3)
    a, b = KChooser(5, cheap), KChooser(5, dear)
    for chooser in (a, b):
        chooser.pooled = [80.0, 100.0]
    assert 0 < a.stop_threshold(Rows(1), 4) < b.stop_threshold(Rows(1), 4) <= 0.9
    assert 0 < a.stop_threshold(Rows(8), 4) < b.stop_threshold(Rows(8), 4) <= 0.9
    assert a.stop_threshold(Rows(1), 0) == 0.0


def test_the_calibration_learns_what_a_drafts_confidence_is_worth():
    chooser = KChooser(5, linear_costs(10e-3, 0.1e-3, 1e-3, 0.01e-3))
    before = float(chooser.calibrated(torch.tensor([0.95])))
    for _ in range(200):  # drafts at 0.95 confidence rejected at once, every time
        chooser.record_confidence([[0.95, 0.95]], offered=[2], counts=[0])
    after = float(chooser.calibrated(torch.tensor([0.95])))
    assert after < 0.2 < before
    assert float(chooser.calibrated(torch.tensor([0.35]))) == pytest.approx(0.35, abs=0.01)  # untouched bin


def test_rows_stop_only_where_reading_their_chance_costs_nothing():
    from specdec.proposers.model import ModelProposer

    rows = Rows(2)
    for device, want in (("cpu", 0.5), ("cuda", 0.0)):
        ctx = SimpleNamespace(device=torch.device(device), chooser=None,
                              options=SimpleNamespace(speculation=SimpleNamespace(draft_confidence=0.5)))
        assert ModelProposer().threshold(ctx, rows, 4) == want
