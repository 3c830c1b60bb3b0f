"""Issue 58, "refuse early" (specdec/preflight.py): a draft whose vocabulary is not the target's and a --max-tokens
beyond the context are refused from the checkpoints' files before any weights load (a 1.5B GGUF takes ~10 s to
load: the refusals used to come after it); --dtype float16/bfloat16 on a CPU without native arithmetic for
them warns with the measured cost. The loaders are replaced by ones that fail the test if called."""
import shutil

import pytest

import specdec.llm as llm_module
from checkpoints import build_hf_model, make_checkpoint, write_wordlevel_tokenizer
from specdec import LLM, preflight
from specdec.models import CheckpointError

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(128)]


class WeightsLoaded(Exception):
    pass


@pytest.fixture
def no_weights(monkeypatch):
    """Every weight loader of `LLM` raises WeightsLoaded: a refusal that comes first loaded none."""
    def refuse(*args, **kwargs):
        raise WeightsLoaded(args[0] if args else kwargs)

    monkeypatch.setattr(llm_module, "load_model", refuse)
    monkeypatch.setattr(llm_module, "load_feature_draft", refuse)


def gguf_file(path, vocab: int, seed: int = 0, tokens=None) -> str:
    pytest.importorskip("gguf")
    from real_model import write_gguf

    hf = build_hf_model("llama", seed=seed, vocab_size=vocab)
    return write_gguf(path, hf.config, hf.state_dict(), tokens=tokens or [f"t{i}" for i in range(vocab)])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """HF directories: a target with a tokenizer, a draft with the same one, one with the words reordered, and
    one of another vocabulary size without a tokenizer."""
    root = tmp_path_factory.mktemp("preflight")
    found = {}
    reordered = WORDS[:3] + WORDS[3:][::-1]
    for name, vocab, words in (("target", 131, WORDS), ("same", 131, WORDS), ("reordered", 131, reordered),
                               ("bigger", 200, None)):
        found[name] = make_checkpoint("llama", root / name, vocab_size=vocab)
        if words:
            write_wordlevel_tokenizer(found[name], words)
    return found


@pytest.mark.parametrize("case", ["sizes without tokenizers", "different tokenizers", "gguf"])
def test_a_mismatched_draft_is_refused_before_any_weights_load(case, dirs, tmp_path, no_weights):
    if case == "gguf":
        target, draft = gguf_file(tmp_path / "t.gguf", 131), gguf_file(tmp_path / "d.gguf", 200, seed=1)
        words = r"different tokenizers/vocabularies \(200 and 131 tokens"
    elif case == "different tokenizers":
        target, draft = dirs["target"], dirs["reordered"]
        words = "different tokenizers/vocabularies"
    else:
        target, draft = dirs["target"], dirs["bigger"]
        words = r"has a vocabulary of 200 ids and target \S+ one of 131"
    with pytest.raises(CheckpointError, match=words) as refused:
        LLM(target, draft, method="eqspec")
    assert "before loading any weights" in str(refused.value)


def test_one_vocabulary_passes_to_the_load(dirs, tmp_path, no_weights):
    """The same tokenizer (byte-identical files, or two GGUF files with one token list) is not refused: the load
    begins (and LLM's own check after it stays the last word)."""
    for target, draft in ((dirs["target"], dirs["same"]),
                          (gguf_file(tmp_path / "t.gguf", 131), gguf_file(tmp_path / "d.gguf", 131, seed=1))):
        with pytest.raises(WeightsLoaded):
            LLM(target, draft, method="eqspec")
    preflight.check_vocabularies(dirs["target"], "suffix")  # a drafter without a model has no vocabulary to check


def test_max_tokens_beyond_the_context_is_refused_before_loading(dirs, tmp_path, no_weights, capsys):
    """`specdec.run --max-tokens` against the context from config.json / the GGUF header (the smaller of the
    two models'), one line, no load; a --max-tokens that fits goes on to the load."""
    from specdec.run import main

    short = make_checkpoint("llama", tmp_path / "short", vocab_size=131, max_position_embeddings=64)
    shutil.copy(f"{dirs['target']}/tokenizer.json", f"{short}/tokenizer.json")
    capsys.readouterr()  # (the checkpoint writer's progress bar)
    assert main(["--target", dirs["target"], "--draft", short, "--prompt", "w1", "--max-tokens", "60", "-k", "4"]) == 2
    err = capsys.readouterr().err
    assert err == (f"specdec.run: error: --max-tokens 60: the model's context is 64 positions ({short}), so an answer "
                   f"can have at most 58 new tokens (after a one-token prompt, with up to 4 drafts in flight); "
                   f"refused before loading any weights\n"), err
    gguf = gguf_file(tmp_path / "t.gguf", 131)  # context 512: its header's llama.context_length
    assert main(["--target", gguf, "--method", "ar", "--prompt", "w1", "--max-tokens", "600"]) == 2
    assert "--max-tokens 600: the model's context is 512 positions" in capsys.readouterr().err
    with pytest.raises(WeightsLoaded):
        main(["--target", dirs["target"], "--draft", short, "--prompt", "w1", "--max-tokens", "58", "-k", "4"])


def test_float16_on_a_cpu_without_native_arithmetic_warns_with_the_measured_cost(dirs, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(preflight, "cpu_flags", lambda: {"avx2", "f16c"})
    line = preflight.dtype_warning("float16", torch.device("cpu"))
    assert line.startswith("specdec: warning: --dtype float16 on a CPU without native float16 arithmetic "
                           "(AVX512-FP16 or AMX-FP16) is slow: in our measurement (SmolLM2-135M) a 128-token "
                           "prefill ran 6-8x slower than float32"), line
    assert preflight.dtype_warning(torch.bfloat16, "cpu").startswith("specdec: warning: --dtype bfloat16 on a CPU")
    for dtype, device in (("float32", "cpu"), (None, "cpu"), ("float16", torch.device("cuda"))):
        assert preflight.dtype_warning(dtype, device) is None
    LLM(dirs["target"], method="ar", dtype="bfloat16", device="cpu")
    assert "specdec: warning: --dtype bfloat16 on a CPU without native bfloat16" in capsys.readouterr().err
    monkeypatch.setattr(preflight, "cpu_flags", lambda: {"avx512_bf16", "amx_bf16"})  # native: no warning
    LLM(dirs["target"], method="ar", dtype="bfloat16", device="cpu")
    assert "warning" not in capsys.readouterr().err


@pytest.mark.real_model
def test_the_qwen_target_refuses_smollm2_as_its_draft_before_loading(no_weights):
    """The Qwen2.5 target with SmolLM2 as its draft (49k and 152k vocabularies): refused from the headers."""
    from bench.fetch_qwen import FETCH_COMMAND, cached_pair
    from real_model import real_gguf

    pair = cached_pair()
    if pair is None:
        pytest.skip(f"the Qwen pair is not cached: {FETCH_COMMAND}")
    with pytest.raises(CheckpointError, match=r"\(49152 and 151936 tokens.*before loading any weights"):
        LLM(pair[0], real_gguf())
