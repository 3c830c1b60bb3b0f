"""`python -m specdec.train` end to end on a tiny target: a feature draft trained for a few steps loads and
decodes exactly (speculative == AR); an interrupted run resumed with --resume ends with the weights an
uninterrupted run has; Ctrl-C keeps the last checkpoint; bad inputs get one line naming the file/line/flag."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import make_checkpoint, write_wordlevel_tokenizer
from specdec import LLM, SamplingParams
from specdec.train import feature, loop
from specdec.train.__main__ import main

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(128)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Llama target with a word-level tokenizer, and a --data file of texts it is trained on."""
    root = tmp_path_factory.mktemp("train")
    target = make_checkpoint("llama", root / "target", seed=3)
    write_wordlevel_tokenizer(target, WORDS)
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, 128, (24,), generator=g)) for _ in range(12)]
    data = root / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root, target, data


def train_argv(target, data, out, *more):
    return ["feature", "--target", str(target), "--data", str(data), "--questions", "0", "--out", str(out),
            "--layers", "1", "--vocab-coverage", "1", "--batch", "4", "--max-len", "32", "--eval-prompts", "0",
            "--threads", "1", "--no-progress", "--device", "cpu", *more]


def weights(out):
    return load_file(str(out / "model.safetensors"))


def test_a_trained_feature_draft_loads_and_decodes_exactly(target, tmp_path):
    root, target_dir, data = target
    out = tmp_path / "draft"
    argv = train_argv(target_dir, data, out, "--steps", "3", "--eval-prompts", "2", "--eval-k", "3",
                      "--eval-tokens", "8")
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["trained_by"].startswith("python -m specdec.train feature --target")
    assert "target_fingerprint" in config
    results = json.loads(out.with_name("draft.train").joinpath("results.json").read_text())
    assert results["train"]["steps"] == 3
    assert results["evaluation"]["held-out"]["matches_greedy"] == results["evaluation"]["held-out"]["prompts"] == 1
    assert out.with_name("draft.train").joinpath("acceptance.png").is_file()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 12], [1, 40, 41], [1, 7]]
    spec = LLM(str(target_dir), str(out), method="eqspec", num_speculative_tokens=3, batch_size=3, dtype="float32")
    ar = LLM(spec.target, method="ar", batch_size=3, dtype="float32", tokenizer=spec.tokenizer)
    got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == [o.token_ids for o in ar.generate(prompt_token_ids=prompts, sampling_params=params)]


def test_resume_after_ctrl_c_ends_with_the_uninterrupted_weights(target, tmp_path, monkeypatch, capsys):
    """Checkpoints every 2 steps; Ctrl-C during step 6 keeps the step-4 checkpoint and exits 130; --resume
    runs steps 5..7 with the restored optimizer, data order and RNG (the noise draws): the saved draft equals
    the one of a 7-step run never stopped."""
    root, target_dir, data = target
    whole = tmp_path / "whole"
    assert main(train_argv(target_dir, data, whole, "--steps", "7", "--checkpoint-every", "0")) == 0

    cut = tmp_path / "cut"
    real_make_loss = feature.make_loss

    def make_loss_interrupted_at(step):
        def make(*args):
            inner, calls = real_make_loss(*args), []

            def loss_fn(draft, batch):
                if draft.training:  # training steps, not validation
                    calls.append(1)
                    if len(calls) == step:
                        raise KeyboardInterrupt
                return inner(draft, batch)
            return loss_fn
        return make

    monkeypatch.setattr(feature, "make_loss", make_loss_interrupted_at(6))
    argv = train_argv(target_dir, data, cut, "--steps", "7", "--checkpoint-every", "2")
    assert main(argv) == 130
    assert "the checkpoint of step 4 is kept" in capsys.readouterr().err
    assert not (cut / "model.safetensors").exists()  # nothing saved as a draft
    state = torch.load(cut.with_name("cut.train") / "checkpoint.pt", weights_only=False)
    assert state["loop"]["step"] == 4
    assert all(int(s["step"]) == 4 for s in state["optimizer"]["state"].values())  # AdamW's own step counts

    monkeypatch.setattr(feature, "make_loss", real_make_loss)
    assert main(argv + ["--resume"]) == 0
    resumed, uninterrupted = weights(cut), weights(whole)
    assert resumed.keys() == uninterrupted.keys()
    for name in uninterrupted:
        assert torch.equal(resumed[name], uninterrupted[name]), name
    results = json.loads(cut.with_name("cut.train").joinpath("results.json").read_text())
    assert results["train"]["steps"] == 7
    assert [c["step"] for c in results["curve"]] == [0, 1, 2, 3, 4, 5, 6, 7]  # the curve survives the restart


def test_the_loop_resumes_a_fixed_run_exactly(tmp_path):
    """loop.train_loop alone: 5 steps in one go == Ctrl-C in step 4 (step 3 checkpointed), then resume to 5
    (model, AdamW, batch order; the cosine schedule is the 5-step one throughout)."""

    class Batches:
        def __init__(self, stop_at=None):
            self.gen, self.calls, self.stop_at = torch.Generator().manual_seed(1), 0, stop_at

        def __call__(self):
            self.calls += 1
            if self.calls == self.stop_at:
                raise KeyboardInterrupt
            return torch.randn(4, 3, generator=self.gen)  # [4, 3]

        def state_dict(self):
            return {"gen": self.gen.get_state()}

        def load_state_dict(self, s):
            self.gen.set_state(s["gen"])

    def run(resume=False, stop_at=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        cfg = loop.TrainConfig(batch=4, lr=0.1, warmup=1, weight_decay=0.0, clip=1.0, minutes=1.0, steps=5,
                               checkpoint=tmp_path / "c.pt", checkpoint_every=1, resume=resume, progress=False)
        loop.train_loop("t", model, Batches(stop_at), lambda m, x: m(x).square().mean(), cfg)
        return model

    whole = run()
    (tmp_path / "c.pt").unlink()
    with pytest.raises(loop.Interrupted) as stop:
        run(stop_at=4)
    assert stop.value.step == 3 and stop.value.path == tmp_path / "c.pt"
    resumed = run(resume=True)
    assert torch.equal(resumed.weight, whole.weight) and torch.equal(resumed.bias, whole.bias)
    fresh = run()  # without --resume a run starts over (and gives the same weights again: seeded)
    assert torch.equal(fresh.weight, whole.weight)


def test_bad_inputs_get_one_clear_line(target, tmp_path, capsys):
    root, target_dir, data = target
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "w1 w2"}) + "\n\n{not json\n")
    with pytest.raises(SystemExit, match=rf"--data {bad}:3: not JSON"):
        main(train_argv(target_dir, bad, tmp_path / "d", "--steps", "1"))
    bad.write_text(json.dumps({"prompt": "a", "text": "b"}) + "\n")
    with pytest.raises(SystemExit, match=rf"--data {bad}:1: expected an object with one of"):
        main(train_argv(target_dir, bad, tmp_path / "d", "--steps", "1"))
    for argv, words in (
            (["feature", "--target", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "d")],
             "--target .*nope.gguf: no such file"),
            (["feature", "--out", str(tmp_path / "d")], "--target is required"),
            (train_argv(target_dir, data, tmp_path / "d", "--steps", "0"), "--steps: must be > 0"),
            (train_argv(target_dir, data, tmp_path / "d", "--pool-seqs", "3"), "--pool-seqs is a flag of `small`"),
            (train_argv(target_dir, data, tmp_path / "d", "--resume"), "--resume: no checkpoint at"),
            (["small", "--target", str(target_dir), "--out", str(tmp_path / "d")], "no tokenizer.model"),
            (train_argv(target_dir, tmp_path / "missing.jsonl", tmp_path / "d"), "--data .*missing.jsonl: file not")):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and __import__("re").search(words, err[0]), (words, err)  # no usage block (issue 44)


@pytest.mark.parametrize("kind, other", [("feature", "small"), ("small", "feature")])
def test_a_kinds_help_lists_its_flags_and_the_shared_ones_only(kind, other, capsys):
    """`python -m specdec.train feature --help` is about feature drafts: small's flags are not listed (and still
    refused by name when given to feature, above)."""
    from specdec.train.__main__ import build_parser, kind_only_flags

    with pytest.raises(SystemExit):
        main([kind, "--help"])
    text = capsys.readouterr().out
    options = {line.split()[0].rstrip(",") for line in text.splitlines() if line.startswith("  -")}
    listed = lambda dest: f"--{dest.replace('_', '-')}" in options  # noqa: E731  (a line of the flag's own)
    owned = kind_only_flags(build_parser())
    assert all(listed(dest) for dest in owned[kind] if dest != "k") and f"{kind} only" in text
    assert not any(listed(dest) for dest in owned[other] if dest != "k") and f"{other} only" not in text
    assert {"--target", "--minutes", "--out"} <= options


def test_the_plot_is_skipped_with_a_line_without_matplotlib(tmp_path, monkeypatch):
    import builtins

    from specdec.train.evaluate import acceptance_plot, acceptance_table

    ev = {"held-out": {"acceptance_by_position": [0.9, 0.5], "acceptance": 0.7, "prompts": 2,
                       "tokens_per_target_call": 2.4, "matches_greedy": 2}}
    assert "0.900  " in acceptance_table(ev) and "2/2" in acceptance_table(ev)
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    line = acceptance_plot(ev, tmp_path / "a.png")
    assert line.startswith("plot skipped: matplotlib is not installed") and not (tmp_path / "a.png").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_legacy_command_of_the_shipped_pair_reads_as_a_specdec_train_command():
    """docs/default_pair.md shows the shipped pair's recorded command (`python -m bench.default_pair ...`, the
    trainer's earlier name) as specdec.train runs it: every flag exists and keeps the old run's values."""
    import shlex

    from specdec.train.__main__ import build_parser
    from specdec.train.report import current_command

    command = current_command("python -m bench.default_pair --specbench q.jsonl --draft-steps 646 --batch-draft 16")
    args = build_parser().parse_args(shlex.split(command)[3:])
    assert args.kind == "small" and args.train_target and args.threads == 2 and args.steps == 646
    assert str(args.out) == "specdec/assets/default_pair/draft" and str(args.doc) == "docs/default_pair.md"
    # (--minutes left out: small's default, 12, is filled in by check_args)
    assert (args.minutes_target, args.minutes_pool, args.minutes, args.batch) == (55.0, 8.0, None, 16)
    today = "python -m specdec.train small --target t --out d"
    assert current_command(today) == today
    with pytest.raises(ValueError, match="no automatic translation"):
        current_command("python -m bench.default_pair --reuse-target t")


@pytest.mark.parametrize("absent, words", [
    (("transformers",), "transformers is not installed"),
    (("google.protobuf",), "protobuf is not installed"),
    (("transformers", "google"), "transformers and protobuf are not installed"),
])
def test_small_without_its_packages_is_one_line_before_any_work(tmp_path, monkeypatch, capsys, absent, words):
    """Issue 44's walk: a fresh `pip install -e .` has neither, and `small` failed with a traceback: at once
    without transformers, after 21 minutes of pool and training without protobuf (saving the draft)."""
    import importlib.util

    from specdec.prompts import DEFAULT_TARGET

    real = importlib.util.find_spec

    def find_spec(name, *more):
        if name in absent:
            return None
        if name.split(".")[0] in absent:
            raise ModuleNotFoundError(name.split(".")[0])
        return real(name, *more)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SystemExit):
        main(["small", "--target", DEFAULT_TARGET, "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{words}: pip install -e '.[train]'" in err[0], err
    assert not (tmp_path / "d").exists()
