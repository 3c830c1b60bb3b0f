"""`python -m specdec.train small` (the default pair's recipe): its pieces on tiny models, and one whole run on
a tiny synthetic "stdlib" (seconds), checking the saved checkpoints, the prompts file and the generated doc."""
import json

import numpy as np
import pytest
import torch


from specdec.train import distill, evaluate, llama_files, loop, stdlib_corpus
from specdec.train.__main__ import main
from specdec.train.report import rewrite
from specdec.prompts import read_prompts

pytestmark = pytest.mark.slow  # not in the fast lane (pytest.ini)

TINY = "hidden=32,layers=1,heads=2,kv_heads=1,ffn=64"


def tiny_model(seed: int, vocab: int = 64, arch: str = TINY):
    return llama_files.build_model(llama_files.llama_config(llama_files.parse_arch(arch), vocab, 64), seed).eval()


def test_per_file_cap_trims_the_largest_files_first():
    lengths = [10, 50, 200, 1000]
    cap = stdlib_corpus.per_file_cap(lengths, 300)
    assert sum(min(n, cap) for n in lengths) <= 300 < sum(min(n, cap + 1) for n in lengths)
    assert stdlib_corpus.per_file_cap(lengths, 10_000) == 1000


def test_windows_start_at_line_starts_with_bos_and_are_seeded():
    newline = 7
    stream = np.array([(i % 9) + 10 if i % 13 else newline for i in range(2000)], dtype=np.int32)
    w = stdlib_corpus.Windows(stream, newline, ctx=32, seed=0)
    assert all(stream[s - 1] == newline for s in w.starts if s > 0)
    batch = w.batch(5)  # [5, 32]
    assert batch.shape == (5, 32) and (batch[:, 0] == stdlib_corpus.BOS).all()
    assert torch.equal(batch, stdlib_corpus.Windows(stream, newline, ctx=32, seed=0).batch(5))


def test_prompts_round_trip_through_the_file(tmp_path):
    source = ('class A:\n    """Doc line.\n\n    More.\n    """\n\n'
              '    def f(self, x):\n        "Return x."\n        return x\n')
    prompts = stdlib_corpus.extract_prompts([source], 5)
    assert prompts == ['class A:\n    """Doc line.', 'def f(self, x):\n    "Return x."']
    stdlib_corpus.write_prompts(tmp_path / "p.txt", prompts)
    assert read_prompts(str(tmp_path / "p.txt")) == prompts
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text(json.dumps({"turns": ["first", "second"]}) + "\n" + json.dumps({"prompt": "p"}) + "\n")
    assert read_prompts(str(jsonl)) == ["first", "p"]


def test_parse_arch_names_the_problem():
    assert llama_files.parse_arch(TINY) == {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "ffn": 64}
    for bad, words in (("hidden=32,layers=1", "needs exactly"), ("hidden=30,layers=1,heads=4,kv_heads=1,ffn=8",
                                                                   "divide"), ("hidden=x", "key=int")):
        with pytest.raises(ValueError, match=words):
            llama_files.parse_arch(bad)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    assert loop.lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert loop.lr_at(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert loop.lr_at(100, 100, 1.0, 10) == pytest.approx(loop.FINAL_LR_FRACTION)


def greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' plain greedy decoding, without a cache."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_speculative_evaluation_is_exact_and_counts_acceptance(tmp_path):
    target, other = tiny_model(0), tiny_model(1)
    for name, model in (("target", target), ("other", other)):
        model.save_pretrained(tmp_path / name)
    prompts = [[1, 5, 9, 12], [1, 40, 41]]
    same, ids, outs = evaluate.speculative_acceptance(tmp_path / "target", tmp_path / "target", prompts, k=3,
                                                      new_tokens=12)
    assert ids == prompts and outs == [greedy(target, p, 12) for p in prompts]
    assert same["acceptance"] == 1.0 and same["acceptance_by_position"] == [1.0] * 3 and same["matches_greedy"] == 2
    assert same["tokens_per_target_call"] == 4.0
    diff, _, outs2 = evaluate.speculative_acceptance(tmp_path / "target", tmp_path / "other", prompts, k=3,
                                                     new_tokens=12)
    assert diff["matches_greedy"] == 2 and outs2 == outs  # a different draft never changes the output
    assert diff["acceptance"] < 1.0
    by_position = diff["acceptance_by_position"]
    assert by_position == sorted(by_position, reverse=True)  # position i is accepted only after 0..i-1


def test_pool_is_the_targets_greedy_continuation_with_its_top_k():
    target = tiny_model(0)
    stream = np.arange(3, 3 + 600, dtype=np.int32) % 60 + 3
    windows = stdlib_corpus.Windows(stream, newline_id=2, ctx=64, seed=0)
    pool = distill.generate_pool(target, windows, seqs=3, minutes=1.0, batch=2, new_tokens=10, prefix_range=(4, 6),
                               top_k=4, seed=0)
    assert len(pool) == 3 and pool.generated_tokens == 30
    for row, length, prefix in zip(pool.tokens, pool.lengths, pool.prefix_lengths):
        prompt = row[:prefix].tolist()
        assert prompt[0] == stdlib_corpus.BOS and (row[length:] == stdlib_corpus.PAD).all()
        assert row[prefix:length].tolist() == greedy(target, prompt, 10)
    i = 0
    L = pool.lengths[i]
    assert (pool.top_ids[i, pool.prefix_lengths[i] - 1: L - 1, 0] == pool.tokens[i, pool.prefix_lengths[i]: L]).all()
    assert (np.diff(pool.top_logp[i, : L - 1], axis=-1) <= 0).all()  # sorted, most likely first


def test_distill_loss_ignores_padding_and_is_smallest_for_the_teacher():
    target, draft = tiny_model(0), tiny_model(1)
    stream = np.arange(600, dtype=np.int32) % 60 + 3
    windows = stdlib_corpus.Windows(stream, newline_id=2, ctx=64, seed=0)
    pool = distill.generate_pool(target, windows, seqs=2, minutes=1.0, batch=1, new_tokens=8, prefix_range=(4, 9),
                               top_k=64, seed=1)
    assert pool.lengths[0] != pool.lengths[1]  # rows of different lengths share a batch, padded
    loss = distill.make_distill_loss(pool, alpha=1.0)
    rows = np.array([0, 1])
    before = loss(draft, rows).item()
    pool.tokens[pool.tokens == stdlib_corpus.PAD] = 17  # whatever sits in the padding must not matter
    assert loss(draft, rows).item() == pytest.approx(before, rel=1e-6)
    assert loss(target, rows).item() < before  # with K = V the soft term is minimal at the teacher itself


def test_pool_cache_round_trips_and_rejects_other_settings(tmp_path):
    target = tiny_model(0)
    windows = stdlib_corpus.Windows(np.arange(600, dtype=np.int32) % 60 + 3, newline_id=2, ctx=64, seed=0)
    pool = distill.generate_pool(target, windows, seqs=3, minutes=1.0, batch=2, new_tokens=5, prefix_range=(4, 6),
                               top_k=4, seed=0)
    path = tmp_path / "pool.npz"
    distill.save_pool(pool, path, {"seqs": 3})
    back = distill.load_pool(path, {"seqs": 3})
    for field in distill.POOL_FIELDS:
        assert np.array_equal(getattr(back, field), getattr(pool, field)), field
    assert back.top_ids.dtype == np.int64 and back.seconds == pytest.approx(pool.seconds)
    assert distill.load_pool(path, {"seqs": 4}) is None


def test_draft_init_from_target_copies_embedding_head_and_first_layers():
    two_layers = TINY.replace("layers=1", "layers=2")
    target, draft = tiny_model(0, arch=two_layers), tiny_model(1)
    copied = llama_files.init_from_target(draft, target)
    assert copied == llama_files.n_params(draft)
    t_params = dict(target.named_parameters())
    for name, param in draft.named_parameters():
        assert torch.equal(param, t_params[name]), name
    with pytest.raises(ValueError, match="hidden_size"):
        llama_files.init_from_target(tiny_model(1, arch="hidden=64,layers=1,heads=2,kv_heads=1,ffn=64"), target)


def test_whole_run_on_a_tiny_corpus(tmp_path):
    stdlib = tmp_path / "lib"
    for i in range(12):
        body = "".join(f'    def method_{j}(self, value):\n        """Return value plus {j}."""\n'
                       f"        return value + {j}\n\n" for j in range(i + 3))
        (stdlib / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (stdlib / f"pkg{i % 3}" / f"mod{i}.py").write_text(f'class Thing{i}:\n    """A thing."""\n\n{body}')
    (stdlib / "test").mkdir()
    (stdlib / "test" / "test_x.py").write_text("excluded = True\n")
    out = tmp_path / "out"
    t_dir, d_dir = out / "pair" / "target", out / "pair" / "draft"
    argv = ["small", "--train-target", "--target", str(t_dir), "--stdlib", str(stdlib), "--out", str(d_dir),
            "--prompts-out", str(out / "prompts.txt"), "--doc", str(out / "doc.md"), "--results",
            str(out / "results.json"), "--holdout-every", "4", "--vocab-size", "300", "--ctx", "64", "--target-arch",
            TINY, "--draft-arch", TINY, "--threads", "1", "--target-steps", "3", "--batch-target", "2",
            "--warmup-target", "1", "--pool-seqs", "4", "--pool-batch", "2", "--pool-new-tokens", "8",
            "--pool-prefix-max", "16", "--steps", "3", "--batch", "2", "--warmup-draft", "1", "--eval-windows", "4",
            "--num-prompts", "3", "-k", "3", "--new-tokens", "8", "--no-progress", "--device", "cpu"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["data"]["n_files"] == 12 and results["data"]["n_held"] == 3
    assert results["spec"]["heldout"]["matches_greedy"] == results["spec"]["heldout"]["prompts"] == 3
    for d in (t_dir, d_dir):
        assert {p.name for p in d.iterdir()} >= {
            "config.json", "model.safetensors", "tokenizer.model", "tokenizer.json", "generation_config.json"}
        assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    from specdec.models import load_model
    from specdec.models.feature_draft import fingerprint

    assert json.loads((d_dir / "config.json").read_text())["target_fingerprint"] == fingerprint(load_model(str(t_dir)))
    assert (d_dir.with_name("draft.train") / "acceptance.png").is_file()  # the plot's default place
    doc = (out / "doc.md").read_text()
    assert f"**{results['heldout']['target_loss']:.4f}**" in doc and f"{results['pair_bytes'] / 2**20:.1f} MiB" in doc
    assert results["command"].startswith("python -m specdec.train small --train-target") and results["command"] in doc
    assert len(read_prompts(str(out / "prompts.txt"))) == 3
    rewrite(out / "results.json", out / "again.md")
    assert (out / "again.md").read_text() == doc  # the doc can be rendered again from the saved results

    # draft-only retrain against the saved target: the target's files stay as they are, the pool is cached
    target_before = {p.name: p.read_bytes() for p in t_dir.iterdir()}
    prompts_before = (out / "prompts.txt").read_text()
    draft_only = ["small", "--target", str(t_dir), "--out", str(d_dir), "--stdlib", str(stdlib), "--holdout-every",
                  "4", "--ctx", "64", "--target-results", str(out / "results.json"), "--pool-cache",
                  str(out / "pool.npz"), "--results", str(out / "draft.json"), "--doc", str(out / "draft.md"),
                  "--draft-init", "target", "--draft-arch", TINY, "--threads", "1", "--pool-seqs", "4",
                  "--pool-batch", "2", "--pool-new-tokens", "8", "--pool-prefix-max", "16", "--steps", "2",
                  "--batch", "2", "--warmup-draft", "1", "--eval-windows", "4", "--num-prompts", "3", "-k", "3",
                  "--new-tokens", "8", "--no-progress"]
    for again in (False, True):
        assert main(draft_only) == 0
        second = json.loads((out / "draft.json").read_text())
        assert second["pool"]["loaded_from_cache"] is again
    assert {p.name: p.read_bytes() for p in t_dir.iterdir()} == target_before
    assert (out / "prompts.txt").read_text() == prompts_before
    assert [run["kind"] for run in second["runs"]] == ["full", "draft-only"]
    assert second["train_target"] == results["train_target"] and second["spec"]["heldout"]["matches_greedy"] == 3
    doc2 = (out / "draft.md").read_text()
    assert results["command"] in doc2 and second["command"] in doc2 and "--draft-init target" in doc2
    # issue 44's walk: docs/train.md's `small --target DIR --out DIR` names no record of the target's run; it
    # trained its draft for 20 minutes, then failed writing its results
    alone = [a for a in draft_only if a not in ("--target-results", str(out / "results.json"), "--doc",
                                                  str(out / "draft.md"))]
    assert main(alone) == 0
    third = json.loads((out / "draft.json").read_text())
    assert [run["kind"] for run in third["runs"]] == ["draft-only"] and third["target_args"] is None
    assert third["spec"]["heldout"]["matches_greedy"] == 3
    (t_dir / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(SystemExit, match="no run there saved"):
        main(draft_only)
