"""One way from flags to an engine (specdec/flags.py): every engine flag reaches `LLM`, in one process,
in the --compare-ar AR run and on --ray replicas; a model object given to `LLM` keeps its packing."""
import argparse
import re
from types import SimpleNamespace

import pytest

import specdec.distributed as distributed
import specdec.run as run
from specdec import LLM
from specdec.flags import add_engine_arguments, engine_kwargs
from specdec.options import all_fields, flag_names
from specdec.models import load_model
from specdec.prompts import DEFAULT_TARGET


def test_every_engine_flag_is_an_option():
    """The flag table is the options' fields: each field one flag, with the field's help, and nothing else but
    --target and --draft; every field is a keyword LLM takes."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    assert set(actions) - {"help", "target", "draft"} == {f.name for f in all_fields()}
    for f in all_fields():
        assert actions[f.name].option_strings[:len(flag_names(f))] == list(flag_names(f)), f.name  # + --no-x
        assert actions[f.name].help == f.metadata["help"], f.name
        assert actions[f.name].default == f.default, f.name
    built = LLM.__new__(LLM)
    with pytest.raises(TypeError, match="unknown option 'batch_sise'; did you mean 'batch_size'"):
        LLM.__init__(built, "/nonexistent", batch_sise=2)


def parser_actions(parser) -> dict:
    """option string -> (dest, help, default, type name, choices) of every flag a parser (and its groups) has."""
    return {s: (a.dest, a.help, a.default, getattr(a.type, "__name__", None), a.choices)
            for a in parser._actions for s in a.option_strings}


def test_one_flag_table_for_every_command():
    """specdec.run, specdec.serve and specdec.train take their model and engine flags from one table: the same
    option strings mean the same option, with the same default, rule and help (serve words --batch-size, train
    --target, for what they do with them); --ray replicas get the same kwargs (test below)."""
    from specdec.serve.__main__ import build_parser as serve_parser
    from specdec.train.__main__ import build_parser as train_parser

    table = parser_actions(run.build_parser())
    serve, train = parser_actions(serve_parser()), parser_actions(train_parser())
    engine = argparse.ArgumentParser()
    add_engine_arguments(engine)
    for flag, action in parser_actions(engine).items():
        assert flag in table and flag in serve, flag
        assert table[flag] == action, flag
        same = action if flag != "--batch-size" else (action[0], serve[flag][1], *action[2:])
        assert serve[flag] == same, flag
    # train's --target is a path (its own wording); its --threads is training's (default 1, no start-up timing)
    assert train["--device"] == table["--device"]
    assert train["--target"][0] == "target" and train["--target"][2] is None


def test_the_options_name_the_runtimes_lookups_formats_and_backends():
    from specdec import options, proposers, schedulers
    from specdec.kernels import dispatch
    from specdec.models import ggml_blocks, quant

    assert options.LOOKUPS == proposers.LOOKUPS
    assert set(options.STORED_BLOCK_TYPES) == set(ggml_blocks.TYPES)  # the --dtype/--quantize help names them
    assert set(options.QUANTIZE) == set(quant.FORMATS)
    assert set(options.KERNEL_BACKENDS) == set(dispatch.BACKENDS)
    assert set(options.METHODS) == set(schedulers.SCHEDULERS)
    assert set(options.SPECULATIVE) == set(schedulers.SPECULATIVE)


def test_run_parser_passes_every_engine_flag():
    args = run.build_parser().parse_args(["--batch-invariant", "--no-packed-weights", "--compile", "--profile",
                                          "--check-weights", "-k", "3", "--method", "ragged", "--dtype", "float64"])
    kwargs = engine_kwargs(args)
    assert kwargs["batch_invariant"] is True and kwargs["packed_weights"] is False
    assert kwargs["compile"] and kwargs["profile"] and kwargs["check_weights"]
    assert (kwargs["num_speculative_tokens"], kwargs["method"], kwargs["dtype"]) == (3, "ragged", "float64")


class Stop(Exception):
    pass


def test_ray_replicas_get_every_engine_flag(monkeypatch):
    """--ray used to drop --batch-invariant and --packed-weights: the replicas' LLM kwargs are now the
    one-process kwargs, with only the device replaced."""
    seen = {}

    def fake_stream_job(ray, chunks, total, replica_kwargs, placement, sink, **kw):
        seen.update(replica_kwargs["llm_kwargs"])
        raise Stop()

    fake_ray = SimpleNamespace(cluster_resources=lambda: {"CPU": 2}, shutdown=lambda: None)
    monkeypatch.setattr(distributed, "import_ray", lambda: fake_ray)
    monkeypatch.setattr(distributed, "connect", lambda ray, address: False)
    monkeypatch.setattr(distributed, "stream_job", fake_stream_job)
    argv = ["--ray", "--replicas", "1", "--device", "cpu", "--batch-invariant", "--no-packed-weights",
            "--prompt", "x", "-k", "2", "--max-tokens", "2", "--no-compare-ar"]
    args = run.build_parser().parse_args(argv)
    with pytest.raises(Stop):
        run.run(args)
    expected = engine_kwargs(args, device=seen["device"])
    assert seen == expected
    assert seen["batch_invariant"] is True and seen["packed_weights"] is False


def test_compare_ar_keeps_no_packed_weights(monkeypatch, capsys):
    """--compare-ar's AR run shares the target: it used to re-pack it, overriding --no-packed-weights."""
    built = []
    original = run.build_llm

    def recording(args, **overrides):
        llm = original(args, **overrides)
        built.append(llm)
        return llm

    monkeypatch.setattr(run, "build_llm", recording)
    code = run.main(["--prompt", "def f(x):", "--max-tokens", "3", "-k", "2", "--batch-size", "1", "--compare-ar",
                     "--no-packed-weights", "--no-progress", "--samples", "0"])
    assert code == 0
    assert len(built) == 2 and built[1].target is built[0].target
    assert built[0].target.packed_linear is False and built[0].draft.packed_linear is False


def test_model_object_keeps_its_packing():
    model = load_model(DEFAULT_TARGET, dtype="float32")
    model.packed_linear = False
    LLM(model, method="ar")  # packed_weights=None: a model object stays as it is
    assert model.packed_linear is False
    LLM(model, method="ar", packed_weights=True)
    assert model.packed_linear is True
    LLM(model, method="ar")
    assert model.packed_linear is True


@pytest.mark.parametrize("program, argv, words", [
    ("specdec.run", ["--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got '0'"),
    ("specdec.run", ["--num-speculative-tokens", "-3"],
     "argument -k/--num-speculative-tokens: must be 'auto' or an integer >= 1, got '-3'"),
    ("specdec.run", ["--method", "fast"],
     "argument --method: invalid choice: 'fast' (choose from 'ar', 'eqspec', 'exspec', 'ragged')"),
    ("specdec.serve", ["--port", "99999"], "argument --port: must be a TCP port, 0 to 65535, got 99999"),
    ("specdec.serve", ["-k", "0"], "argument -k/--num-speculative-tokens: must be 'auto' or an integer >= 1, got '0'"),
    ("specdec.train", ["feature", "--target", "x.gguf"], "the following arguments are required: --out"),
    ("specdec.convert", [], "the following arguments are required: gguf, out_dir"),
])
def test_a_refused_flag_is_one_line_without_the_usage_block(program, argv, words):
    """Issue 44: argparse prints 26 lines of usage before its error; every CLI says the one line, naming the flag."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", program, *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"{program}: error: {words} (`python -m {program} --help` lists the flags)\n"


def test_k_help_says_what_k_takes():
    """-k's help: auto chooses from 0 up (0: a step without the draft); a fixed k is >= 1 (0 is refused)."""
    text = " ".join(run.build_parser().format_help().split())
    assert "a fixed integer >= 1" in text and "(0 = a step without the draft)" not in text


def test_the_runtime_reads_no_specdec_environment_variable():
    """Issue 51: SPECDEC_COMPILE, SPECDEC_CHECK_INVARIANTS and SPECDEC_KERNELS duplicated LLM arguments (compile,
    check_invariants, kernel_backend) through the environment. The runtime (specdec/, models/, kernels/) names no
    SPECDEC_* variable now; the test suite's own switches (SPECDEC_TEST_*) are read by tests/conftest.py alone."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    named = [f"{path.relative_to(root)}:{n}" for folder in ("specdec", "models", "kernels")
             for path in sorted((root / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if "SPECDEC_" in line]
    assert not named, f"the runtime names SPECDEC_* variables: {named}"


def test_help_gives_a_default_once():
    """Issue 51: 15 `--help` entries ended in '(default: None)', some after a sentence giving the default. A flag
    whose text says its default, or whose default is None or False, gets no '(default: ...)' suffix; the others
    get theirs."""
    from specdec.flags import HelpFormatter, Parser

    parser = Parser(prog="x", formatter_class=HelpFormatter)
    add_engine_arguments(parser)
    formatter = parser._get_formatter()
    for action in parser._actions[1:]:
        text = formatter._get_help_string(action)
        says = action.default is None or action.default is False or "default" in (action.help or "").lower()
        assert text.endswith("(default: %(default)s)") != says, action.dest


def program_parsers() -> dict:
    """Every command line's parser, by program (specdec.train's: both kinds' flags)."""
    from specdec.chat import build_parser as chat_parser
    from specdec.serve.__main__ import build_parser as serve_parser
    from specdec.train.__main__ import build_parser as train_parser

    return {"specdec.run": run.build_parser(), "specdec.serve": serve_parser(), "specdec.chat": chat_parser(),
            "specdec.train": train_parser()}


# what a help text says its default is: the word after "default" (", default: X", "Default X:", "(default X;") or
# before "(default)"; "the default pair / target / draft" (the embedded pair) names no default value
STATED = re.compile(r"(?i)\bdefault\b(?! pair| target| draft)[:=]?\s+([^\s;,)]+)|(\S+) \(default\)")


def stated_defaults(text: str) -> list[str]:
    return [(a or b).strip("'\".:()") for a, b in STATED.findall(text or "")]


def test_no_help_names_a_default_other_than_the_real_one():
    """Issue 58: --dtype's help said "(default float32; ...)" while its default (None) keeps a GGUF's blocks, and
    passing float32 dequantizes them; --temperature and --top-k showed no default (0.0 and 0 fell under "a None or
    False default is said in the text": 0 == False); --prompt showed "(default: [])"; the description named neither
    GGUF nor Qwen2.5; --device spoke of "a model object", which no command line can give. For every flag of every
    command line: a default its text states is the real one (a None default is never stated as one of the flag's
    own choices, which would then have to mean the same), and the suffix the formatter adds is a real value."""
    for program, parser in program_parsers().items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help in (None, argparse.SUPPRESS):
                continue
            for word in stated_defaults(action.help):
                if action.default is None or action.default is False:
                    assert word not in [str(c) for c in action.choices or ()], (program, action.dest, word)
                else:
                    assert word == str(action.default), (program, action.dest, word, action.default)
            if formatter._get_help_string(action) != action.help:  # the formatter's suffix: a plain value
                assert action.default is not None and action.default is not False and \
                    not isinstance(action.default, list), (program, action.dest)
        text = " ".join(parser.format_help().split())
        for wrong in ("(default: [])", "(default: None)", "(default: False)", "model object", "default float32"):
            assert wrong not in text, (program, wrong)
    text = " ".join(run.build_parser().format_help().split())
    for right in ("0 = greedy; > 0 samples (rejection sampling keeps the target's distribution exactly) (default: "
                  "0.0)", "keep the k most likely tokens (0 = off) (default: 0)", "GGUF files of Llama, Qwen2/Qwen2.5 "
                  "and Qwen3", "--dtype, float32 too, asks for float weights"):
        assert right in text, right
    assert stated_defaults("x (default float32; y). Default: on. auto (default): z; the default pair") == \
        ["float32", "on", "auto"]  # (what the rule reads)
