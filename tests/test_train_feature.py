"""`python -m specdec.train feature`'s pieces (specdec/train/feature.py, self_data.py): the training forward
is the runtime's forward, labels only where the target answers, the draft vocabulary covers what it says,
and the held-out check sees shared text."""
import torch

from specdec.train import feature as fd
from specdec.train.__main__ import build_parser
from specdec.train.self_data import clean_question, question_requests
from specdec.models import load_model


def test_training_forward_is_the_runtime_forward(llama_pair):
    """What the trainer optimises is what the runtime runs: the same draft, ids and features give the same
    hidden states through `train_forward` (no cache, causal attention) and `FeatureDraft.forward` (a cache)."""
    target = load_model(llama_pair[0], dtype="float64")
    vocab = torch.arange(0, target.vocab_size, 2)
    draft = fd.init_draft(target, vocab, layers=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    ids = torch.randint(3, target.vocab_size, (2, 9), generator=g)  # [2, 9]
    before = fd.shift_right(torch.randn(2, 9, target.cfg.hidden_size, generator=g, dtype=torch.float64))
    trained = fd.train_forward(draft, ids, before)  # [2, 9, E]
    logits, served = draft.forward(ids, draft.new_cache(2, 9), features=before, hidden="all")
    torch.testing.assert_close(trained, served, rtol=1e-9, atol=1e-9)
    head = torch.nn.functional.linear(draft.norm(trained), draft.lm_head.weight)  # [2, 9, V']
    assert torch.equal(vocab[head.argmax(-1)], logits.argmax(-1))  # the reduced head maps back to the same ids


def test_collate_labels_only_the_answer_and_the_draft_vocabulary():
    vocab_index = torch.full((10,), -100)
    vocab_index[torch.tensor([2, 5, 7])] = torch.arange(3)
    seqs = [[1, 2, 3, 4, 5], [6, 7]]
    data = {"features": [torch.ones(5, 4), torch.ones(2, 4)],
            "labels": [torch.tensor([2, 3, 4, 5, 7]), torch.tensor([7, 5])], "prompt_lengths": [3, 1]}
    ids, f, y, valid = fd.collate(seqs, data, [0, 1], vocab_index, max_len=16)
    assert ids.shape == (2, 5) and f.shape == (2, 5, 4)
    assert y.tolist() == [[-100, -100, -100, 1, 2], [2, 1, -100, -100, -100]]  # 3, 4 are outside the vocabulary
    assert valid.tolist() == [[True] * 5, [True, True, False, False, False]]


def test_draft_vocabulary_covers_what_it_reports():
    labels = [torch.tensor([1] * 50 + [2] * 30 + [3] * 15 + [4] * 5)]
    vocab, coverage = fd.draft_vocabulary(labels, 0.8, vocab_size=600)
    assert 1 in vocab and 2 in vocab and len(vocab) == 256 and coverage == 1.0  # whole tiles of 256 ids
    assert vocab.tolist() == sorted(vocab.tolist())


def test_held_out_check_and_question_cleaning():
    assert fd.shared_ngrams(["please tell me what the capital city of france is today"],
                            ["What the capital city of France is today, please?"], n=6) == 1
    assert fd.shared_ngrams(["a completely different question about bees"], ["What is the capital of France?"]) == 0
    assert clean_question('A user might ask: "How do volcanoes form and why?"') == "How do volcanoes form and why?"
    assert clean_question("Sure") is None
    asks = question_requests(5, seed=0)
    assert len(set(asks)) == 5 and asks == question_requests(5, seed=0) != question_requests(5, seed=1)


def test_data_rounds_are_cached_per_round_and_a_repeated_question_is_kept_once(tmp_path, monkeypatch):
    """Round r is self_data with seed --seed + r, its features computed once and cached beside it; a question
    an earlier round asked is dropped with its sequence and features (the held-out split stays clean)."""
    rounds = {0: ["q a", "q b"], 1: ["q b", "q c"]}  # round 1 repeats "q b"

    def fake_text(target, cfg, cache, log):
        qs = rounds[cfg.seed]
        return {"questions": qs, "sequences": [[ord(q[-1]), 1, 2] for q in qs], "prompt_lengths": [1] * len(qs),
                "seconds": 10.0, "key": {"seed": cfg.seed}}

    calls = []

    def fake_features(target, sequences):
        calls.append(len(sequences))
        return {"features": [torch.full((3, 2), float(s[0])) for s in sequences],
                "labels": [torch.tensor(s) for s in sequences]}

    monkeypatch.setattr(fd.self_data, "load_or_generate", fake_text)
    monkeypatch.setattr(fd, "target_features", fake_features)
    args = build_parser().parse_args(["feature", "--target", "t.gguf", "--out", str(tmp_path / "d"), "--cache",
                                      str(tmp_path), "--data-rounds", "2", "--questions", "2"])
    text, data, seconds_text, _ = fd.training_text(None, args)
    assert text["questions"] == ["q a", "q b", "q c"] and calls == [2, 2]
    assert [s[0] for s in text["sequences"]] == [ord("a"), ord("b"), ord("c")]
    assert [float(f[0, 0]) for f in data["features"]] == [ord("a"), ord("b"), ord("c")]  # rows stay aligned
    assert data["prompt_lengths"] == [1, 1, 1] and seconds_text == 20.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["features_seed0.pt", "features_seed1.pt"]
    fd.training_text(None, args)
    assert calls == [2, 2]  # the second time every round's features come from the cache
