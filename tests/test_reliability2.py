"""Issue 26, reliability second pass: one case per defect and weak spot that lives in the models, prompt
files, the --output writer, path checks and the kernel backend choice.

Fast and mostly in-process (no decoding): config.json field by field, unreadable and escaping weight files,
chat-template render errors, prompt files (BOM, non-regular paths, deep JSON, lone surrogates), the
--output writer (whole lines after a cut-off write, interrupts keep what finished, read-only files),
`check_paths` (outputs that are inputs or each other, --metrics writable up front) and
`--kernel-backend triton` where Triton cannot run. The CLI cases at the end drive `python -m specdec.run`.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import pytest
import torch

from specdec.models import CheckpointError, ModelConfig, load_model, load_tokenizer
from specdec.output import JsonlOutput, OutputError, check_paths, record
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET, read_prompts

from cli_helpers import fake_output, hidden, jsonl_indexes, quick_cli as cli

# --------------------------------------------------------------------------- config.json, field by field

BASE_CONFIG = json.load(open(os.path.join(DEFAULT_DRAFT, "config.json"), encoding="utf-8"))


def config_dir(tmp_path, edit=None, raw=None) -> str:
    """A directory holding only a config.json: the default draft's, changed by `edit`, or `raw` as it is."""
    if raw is None:
        raw = json.loads(json.dumps(BASE_CONFIG))
        edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return str(tmp_path)


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("key,value,expected", [
    ("max_position_embeddings", 0, "'max_position_embeddings' must be an integer >= 1, got 0"),
    ("max_position_embeddings", -5, "'max_position_embeddings' must be an integer >= 1, got -5"),
    ("num_attention_heads", -4, "'num_attention_heads' must be an integer >= 1, got -4"),
    ("num_hidden_layers", -2, "'num_hidden_layers' must be an integer >= 1, got -2"),
    ("num_hidden_layers", 2.5, "'num_hidden_layers' must be an integer >= 1, got 2.5"),
    ("vocab_size", "4000", "'vocab_size' must be an integer >= 1, got '4000' (a string)"),
    ("hidden_size", True, "'hidden_size' must be an integer >= 1, got True (a boolean)"),
    ("num_key_value_heads", 0, "'num_key_value_heads' must be an integer >= 1, got 0"),
    ("rms_norm_eps", "abc", "'rms_norm_eps' must be a finite number > 0, got 'abc' (a string)"),
    ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a finite number > 0, got nan"),
    ("rms_norm_eps", -1e-6, "'rms_norm_eps' must be a finite number > 0, got -1e-06"),
    ("rope_parameters", {"rope_theta": float("inf"), "rope_type": "default"},
     "'rope_parameters.rope_theta' must be a finite number > 0, got inf"),
    ("rope_parameters", {"rope_theta": 1e4, "partial_rotary_factor": 2},
     "'rope_parameters.partial_rotary_factor' must be a finite number in (0, 1], got 2"),
    ("rope_parameters", ["default"], "'rope_parameters' must be an object, got ['default'] (a list)"),
    ("tie_word_embeddings", "false", "'tie_word_embeddings' must be true or false, got 'false' (a string)"),
    ("eos_token_id", [2, "x"], "'eos_token_id' must be a token id (an integer >= 0) or a list of them"),
    ("architectures", "LlamaForCausalLM", "'architectures' must be a list of class names"),
])
def test_config_fields_are_checked_naming_file_and_key(tmp_path, key, value, expected):
    path = config_dir(tmp_path, lambda raw: raw.__setitem__(key, value))
    with pytest.raises(CheckpointError) as info:
        ModelConfig.from_dir(path)
    assert one_line(info.value).startswith(os.path.join(path, "config.json") + ": ") and expected in str(info.value)


def test_integral_floats_and_absent_optional_fields_are_fine(tmp_path):
    def edit(raw):
        raw["hidden_size"] = float(raw["hidden_size"])  # 256.0 is 256
        raw["rope_parameters"] = {"rope_theta": 500000, "rope_type": "default"}  # an integer theta is a number
        for optional in ("max_position_embeddings", "rms_norm_eps", "num_key_value_heads", "head_dim"):
            raw.pop(optional)

    cfg = ModelConfig.from_dir(config_dir(tmp_path, edit))
    hidden = BASE_CONFIG["hidden_size"]
    assert cfg.hidden_size == hidden and cfg.max_position_embeddings == 4096 and cfg.rope_theta == 500000.0
    assert cfg.num_kv_heads == cfg.num_heads and cfg.head_dim == hidden // cfg.num_heads


@pytest.mark.parametrize("raw,kind", [([BASE_CONFIG], "a list"), ("config", "a string"), (None, "null")])
def test_config_that_is_not_an_object_is_one_line(tmp_path, raw, kind):
    (tmp_path / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(CheckpointError) as info:
        ModelConfig.from_dir(str(tmp_path))
    assert one_line(info.value) == f"{tmp_path / 'config.json'}: expected a JSON object at the top level, got {kind}"


def test_generation_config_that_is_a_list_names_its_file(tmp_path):
    path = config_dir(tmp_path, lambda raw: None)
    (tmp_path / "generation_config.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(CheckpointError, match="generation_config.json: expected a JSON object at the top level"):
        ModelConfig.from_dir(path)


def test_hidden_size_not_divisible_without_head_dim(tmp_path):
    def edit(raw):
        raw.pop("head_dim")
        raw["num_attention_heads"] = 5
        raw["num_key_value_heads"] = 5

    hidden = BASE_CONFIG["hidden_size"]
    with pytest.raises(CheckpointError, match=f"hidden_size {hidden} is not a multiple of num_attention_heads 5"):
        ModelConfig.from_dir(config_dir(tmp_path, edit))


@pytest.fixture
def draft_copy(tmp_path):
    """A copy of the embedded default draft checkpoint (7 MB)."""
    dst = tmp_path / "draft"
    shutil.copytree(DEFAULT_DRAFT, dst)
    return dst


def test_negative_layer_count_is_a_config_error_not_an_unexpected_weight(draft_copy):
    raw = json.loads((draft_copy / "config.json").read_text())
    raw["num_hidden_layers"] = -2
    (draft_copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as info:
        load_model(str(draft_copy))
    assert "unexpected weight" not in str(info.value)
    assert str(info.value) == f"{draft_copy / 'config.json'}: 'num_hidden_layers' must be an integer >= 1, got -2"


# --------------------------------------------------------------------------- weight files


def test_single_file_symlink_out_of_the_checkpoint_is_refused(draft_copy, tmp_path):
    """The shard rule (tests/test_loader_errors.py) holds for a lone model.safetensors too."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(draft_copy / "model.safetensors", outside / "weights.safetensors")
    os.symlink(outside / "weights.safetensors", draft_copy / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_model(str(draft_copy))
    assert one_line(info.value) == (f"{draft_copy / 'model.safetensors'}: resolves to {outside / 'weights.safetensors'}"
                                     f", outside the checkpoint directory")


def test_single_file_symlink_inside_the_checkpoint_loads(draft_copy):
    (draft_copy / "blobs").mkdir()
    shutil.move(draft_copy / "model.safetensors", draft_copy / "blobs" / "abc")
    os.symlink("blobs/abc", draft_copy / "model.safetensors")
    reference = load_model(DEFAULT_DRAFT)
    model = load_model(str(draft_copy))
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))


def test_broken_single_file_symlink_says_so(draft_copy):
    os.unlink(draft_copy / "model.safetensors")
    os.symlink("gone.safetensors", draft_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors: broken symlink"):
        load_model(str(draft_copy))


UNREADABLE_SCRIPT = """
import sys
from specdec.models import CheckpointError, load_model
try:
    load_model(sys.argv[1])
except CheckpointError as err:
    print(err)
"""


def test_unreadable_weights_say_permission_denied():
    """safetensors reports EACCES as "No such file or directory"; the loader must say what is true. As root,
    permissions do not bind, so the load runs as an unprivileged user in a user namespace (`unshare -U`)."""
    root = tempfile.mkdtemp(prefix="specdec-unreadable-")
    try:
        os.chmod(root, 0o755)
        path = os.path.join(root, "draft")
        shutil.copytree(DEFAULT_DRAFT, path)
        os.chmod(path, 0o755)
        weights = os.path.join(path, "model.safetensors")
        os.chmod(weights, 0)
        if os.geteuid() == 0:
            if shutil.which("unshare") is None:
                pytest.skip("running as root without unshare: cannot make a file unreadable")
            command = ["unshare", "-U", sys.executable, "-c", UNREADABLE_SCRIPT, path]
        else:
            command = [sys.executable, "-c", UNREADABLE_SCRIPT, path]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        if result.returncode != 0 and "unshare" in result.stderr:
            pytest.skip(f"user namespaces unavailable: {result.stderr.strip()}")
        assert result.stdout.strip() == f"{weights}: cannot read (Permission denied)", result.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- chat template


@pytest.mark.parametrize("template,kind", [
    ("{{ raise_exception('system messages are not supported') }}", "TemplateError"),
    ("{{ messages[3].content.upper() }}", "UndefinedError"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
])
def test_chat_template_render_errors_are_one_line(tmp_path, template, kind):
    path = tmp_path / "tok"
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(os.path.join(DEFAULT_TARGET, name), path / name)
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    tokenizer = load_tokenizer(str(path))
    with pytest.raises(CheckpointError) as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert one_line(info.value).startswith(f"{path}: chat_template failed to render ({kind}")


# --------------------------------------------------------------------------- prompt files

BOM = "\ufeff"


def test_bom_is_stripped_from_txt_prompt_files(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text(BOM + "hello\nworld\n", encoding="utf-8")
    assert read_prompts(str(path)) == ["hello", "world"]
    path.write_text(BOM + "# a comment after the BOM\nhello\n", encoding="utf-8")
    assert read_prompts(str(path)) == ["hello"]


def test_bom_is_stripped_from_jsonl_prompt_files(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(BOM + json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "x"}) + "\n",
                    encoding="utf-8")
    assert read_prompts(str(path)) == ["hello", "x"]


def test_a_bom_later_in_the_file_is_text(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a\n" + BOM + "b\n", encoding="utf-8")
    assert read_prompts(str(path)) == ["a", BOM + "b"]


def test_directory_as_prompts_says_directory(tmp_path):
    with pytest.raises(ValueError) as info:
        read_prompts(str(tmp_path))
    assert one_line(info.value) == f"{tmp_path}: is a directory, not a prompt file; give a regular .txt or .jsonl file"


def test_fifo_as_prompts_says_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError) as info:
        read_prompts(str(fifo))  # before: "not found"; opening it would block until a writer came
    assert one_line(info.value) == f"{fifo}: is a pipe (FIFO), not a prompt file; give a regular .txt or .jsonl file"


def test_dev_stdin_as_prompts_says_what_it_is():
    if stat.S_ISREG(os.fstat(0).st_mode):
        pytest.skip("stdin is a regular file here, which is a fine prompt file")
    with pytest.raises(ValueError) as info:
        read_prompts("/dev/stdin")
    message = one_line(info.value)
    assert "not found" not in message and message.startswith("/dev/stdin: is a ")
    assert message.endswith("not a prompt file; give a regular .txt or .jsonl file")


def test_missing_prompt_file_still_says_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path}/nope.txt: prompt file not found$"):
        read_prompts(str(tmp_path / "nope.txt"))


def test_deeply_nested_json_is_one_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError) as info:
        read_prompts(str(path))
    assert one_line(info.value) == f"{path}:2: JSON nested too deeply to read"


@pytest.mark.parametrize("record,field", [({"prompt": "ab\\ud800c"}, "'prompt'"),
                                          ({"turns": ["\\udfff"]}, "'turns'[0]")])
def test_lone_surrogate_names_file_and_line(tmp_path, record, field):
    path = tmp_path / "s.jsonl"
    line = json.dumps(record).replace("\\\\", "\\")  # the JSON escape itself, as a file would hold it
    path.write_text(json.dumps({"prompt": "ok"}) + "\n\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        read_prompts(str(path))
    assert one_line(info.value).startswith(f"{path}:3: {field} holds a lone surrogate")


# --------------------------------------------------------------------------- --output writer


OUTPUTS = [fake_output(i) for i in range(6)]
PROMPTS = [f"p{i}" for i in range(6)]


def test_write_cut_off_mid_line_keeps_whole_lines_only(tmp_path, monkeypatch):
    """A write that stops part-way through a line (disk full after N bytes): the partial file is cut back
    to the lines before it, and the error says how many it holds."""
    path = tmp_path / "out.jsonl"
    sizes = [len(json.dumps(record(OUTPUTS[i], PROMPTS[i])).encode()) + 1 for i in range(2)]
    real_write, budget = os.write, {"left": sum(sizes) + sizes[0] // 2}  # two lines and half of the third

    def disk_fills(fd, data):
        if budget["left"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_write(fd, bytes(data[: budget["left"]]))
        budget["left"] -= n
        return n

    with pytest.raises(OutputError, match="cannot write .No space left on device") as info:
        with JsonlOutput.open(str(path)) as out:
            monkeypatch.setattr(os, "write", disk_fills)
            for i in range(4):
                out.write(OUTPUTS[i], PROMPTS[i])
    monkeypatch.undo()
    partial, lines = info.value.specdec_partial
    assert jsonl_indexes(partial) == [0, 1] and lines == 2 and not path.exists()


FSIZE_SCRIPT = """
import resource, sys
from types import SimpleNamespace
from specdec.output import JsonlOutput
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
o = lambda i: SimpleNamespace(index=i, text="x" * 50, token_ids=[i] * 20, prompt_token_ids=[1], finish_reason="length",
                              accepted_counts=[1], speculative_tokens=[3], latency_s=0.5, time_to_first_token_s=0.1)
try:
    with JsonlOutput.open(sys.argv[1]) as out:
        for i in range(50):
            out.write(o(i), "p")
except OSError as err:
    print(err.specdec_partial[0], err.specdec_partial[1], err)
"""


def test_file_size_limit_mid_line_keeps_whole_lines_only(tmp_path):
    """The real thing: `ulimit -f` (RLIMIT_FSIZE) stops the write inside a line with EFBIG."""
    output = tmp_path / "out.jsonl"
    result = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(output), "1000"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    partial, lines, message = result.stdout.strip().split(" ", 2)
    assert "File too large" in message
    assert jsonl_indexes(partial) == list(range(int(lines))) and int(lines) >= 1
    assert os.path.getsize(partial) <= 1000


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_interrupt_keeps_the_finished_requests(tmp_path, interrupt):
    """Issue 26: an interrupt keeps the partial file like any other failure (it used to remove it)."""
    path = tmp_path / "out.jsonl"
    path.write_text("previous run\n")
    with pytest.raises(interrupt) as info:
        with JsonlOutput.open(str(path)) as out:
            out.write(OUTPUTS[3], PROMPTS[3])
            out.write(OUTPUTS[1], PROMPTS[1])
            raise interrupt()
    partial, lines = info.value.specdec_partial
    assert jsonl_indexes(partial) == [3, 1] and lines == 2 and out.kept == partial
    assert hidden(tmp_path) == [os.path.basename(partial)]
    assert path.read_text() == "previous run\n"
    assert out.note("the interrupt") == (f"; --output {path} left as it was; the 2 request(s) finished before the "
                                         f"interrupt are in {partial}")


def test_ctrl_c_in_the_middle_of_a_line_does_not_tear_it(tmp_path, monkeypatch):
    """A real SIGINT arriving while a line is half written: the kept file holds whole lines only, exactly as
    many as the count says (the torn line is cut off; where the interrupt lands decides whether it counts)."""
    path = tmp_path / "out.jsonl"
    real_write = os.write
    calls = {"n": 0}

    def slow_write(fd, data):
        calls["n"] += 1
        if calls["n"] == 2:  # the second line: half of it, then Ctrl-C
            n = real_write(fd, bytes(data[: len(data) // 2]))
            os.kill(os.getpid(), signal.SIGINT)
            return n
        return real_write(fd, data)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the runner ignores SIGINT
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            with JsonlOutput.open(str(path)) as out:
                monkeypatch.setattr(os, "write", slow_write)
                for i in range(4):
                    out.write(OUTPUTS[i], PROMPTS[i])
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    partial, lines = info.value.specdec_partial
    kept = jsonl_indexes(partial)
    assert kept == [0, 1, 2, 3][:lines] and 1 <= lines < 4 and not path.exists()


def test_interrupt_before_any_request_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt) as info:
        with JsonlOutput.open(str(tmp_path / "out.jsonl")) as out:
            raise KeyboardInterrupt()
    assert os.listdir(tmp_path) == [] and not hasattr(info.value, "specdec_partial")
    assert out.note("the interrupt") == f"; --output {tmp_path / 'out.jsonl'} left as it was"


def test_read_only_output_is_refused_until_made_writable(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("keep me\n")
    os.chmod(path, 0o444)
    with pytest.raises(OutputError) as info:
        JsonlOutput.open(str(path))
    assert str(info.value) == (f"--output {path}: is read-only (mode 0444); to replace it, make it writable "
                               f"(chmod u+w) or delete it")
    assert path.read_text() == "keep me\n" and os.listdir(tmp_path) == ["out.jsonl"]
    os.chmod(path, 0o644)  # the deliberate replacement
    with JsonlOutput.open(str(path)) as out:
        out.write(OUTPUTS[0], PROMPTS[0])
        out.commit(OUTPUTS[:1], PROMPTS[:1])
    assert jsonl_indexes(path) == [0]


def test_read_only_output_through_a_symlink_is_refused(tmp_path):
    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    real.write_text("keep me\n")
    os.chmod(real, 0o400)
    os.symlink(real, link)
    with pytest.raises(OutputError, match="is read-only .mode 0400."):
        JsonlOutput.open(str(link))


# --------------------------------------------------------------------------- check_paths


@pytest.fixture
def inputs(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    return prompts, checkpoint


def unchanged(prompts, checkpoint) -> bool:
    return prompts.read_text() == json.dumps({"prompt": "hi"}) + "\n" and \
        (checkpoint / "model.safetensors").read_bytes() == b"weights"


@pytest.mark.parametrize("case", ["output is prompts", "metrics is prompts", "output links to prompts",
                                  "output is a hard link of prompts", "output is a checkpoint file",
                                  "metrics links to a checkpoint file"])
def test_outputs_that_are_inputs_are_refused(tmp_path, inputs, case):
    prompts, checkpoint = inputs
    link = tmp_path / "link"
    if case == "output links to prompts":
        os.symlink(prompts, link)
    elif case == "output is a hard link of prompts":
        os.link(prompts, link)
    elif case == "metrics links to a checkpoint file":
        os.symlink(checkpoint / "model.safetensors", link)
    output, metrics, flag, clash = {
        "output is prompts": (prompts, None, "--output", prompts),
        "metrics is prompts": (tmp_path / "o.jsonl", prompts, "--metrics", prompts),
        "output links to prompts": (link, None, "--output", prompts),
        "output is a hard link of prompts": (link, None, "--output", prompts),
        "output is a checkpoint file": (checkpoint / "config.json", None, "--output", checkpoint / "config.json"),
        "metrics links to a checkpoint file": (None, link, "--metrics", checkpoint / "model.safetensors"),
    }[case]
    shown = output if flag == "--output" else metrics
    with pytest.raises(OutputError) as info:
        check_paths(output and str(output), metrics and str(metrics), [str(prompts), str(checkpoint), None])
    assert str(info.value) == (f"{flag} {shown}: is the input file {clash}; writing it would destroy it, choose "
                               f"another path")
    assert unchanged(prompts, checkpoint)


@pytest.mark.parametrize("exists", [False, True])
def test_output_and_metrics_on_one_file_are_refused(tmp_path, inputs, exists):
    path = tmp_path / "x.json"
    if exists:
        path.write_text("{}")
    with pytest.raises(OutputError) as info:
        check_paths(str(path), str(path), [str(p) for p in inputs])
    assert str(info.value) == f"--metrics {path}: is the same file as --output {path}; give them different paths"


@pytest.mark.parametrize("case,message", [
    ("missing directory", "directory {d}/nope does not exist"), ("directory", "is a directory"),
    ("read-only file", "is read-only (mode 0444); to replace it, make it writable (chmod u+w) or delete it"),
    ("unwritable directory", "cannot create the file ("),
])
def test_unwritable_metrics_are_refused_up_front(tmp_path, inputs, case, message):
    metrics = {"missing directory": tmp_path / "nope" / "m.json", "directory": tmp_path,
               "read-only file": tmp_path / "m.json", "unwritable directory": "/proc/specdec-metrics.json"}[case]
    if case == "read-only file":
        metrics.write_text("old")
        os.chmod(metrics, 0o444)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(OutputError) as info:
        check_paths(None, str(metrics), [str(p) for p in inputs])
    assert str(info.value).startswith(f"--metrics {metrics}: ") and message.format(d=tmp_path) in str(info.value)
    assert sorted(os.listdir(tmp_path)) == before


def test_good_paths_pass_and_leave_nothing_behind(tmp_path, inputs):
    before = sorted(os.listdir(tmp_path))
    check_paths(str(tmp_path / "o.jsonl"), str(tmp_path / "m.json"), [str(p) for p in inputs])
    check_paths("/dev/null", "/dev/null", [str(p) for p in inputs])  # a device may take both
    (tmp_path / "m.json").write_text("old metrics")
    check_paths(str(tmp_path / "o.jsonl"), str(tmp_path / "m.json"), [str(p) for p in inputs])
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["m.json"])


# --------------------------------------------------------------------------- kernel backend


def test_triton_backend_without_gpu_or_interpreter_is_one_value_error(monkeypatch):
    from specdec.kernels import dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    with pytest.raises(ValueError) as info:
        dispatch.choose_backend(torch.zeros(1), "triton")
    assert one_line(info.value).startswith("kernel backend 'triton': the Triton kernels need a CUDA GPU, or "
                                           "TRITON_INTERPRET=1")
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="^kernel backend 'triton': triton is not installed"):
        dispatch.choose_backend(torch.zeros(1), "triton")


# --------------------------------------------------------------------------- the CLI, end to end


QUICK = ["--max-tokens", "2", "-k", "2", "--no-compare-ar", "--no-progress", "--samples", "0"]


def assert_one_error_line(result, code=2):
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_triton_kernels_without_interpreter_is_one_line():
    result = cli("--prompt", "hello", "--kernel-backend", "triton", *QUICK, env={"TRITON_INTERPRET": "0"})
    assert_one_error_line(result)
    assert "kernel backend 'triton': the Triton kernels need a CUDA GPU" in result.stderr


def test_cli_prompts_fifo_and_deep_json_are_one_line(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    result = cli("--prompts", str(fifo), *QUICK)
    assert_one_error_line(result)
    assert "is a pipe (FIFO), not a prompt file" in result.stderr
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    result = cli("--prompts", str(deep), *QUICK)
    assert_one_error_line(result)
    assert f"{deep}:1: JSON nested too deeply to read" in result.stderr


# Cases that go through specdec/run.py's and specdec/llm.py's checks.


@pytest.mark.parametrize("case", ["output is prompts", "metrics is prompts", "metrics is output"])
def test_cli_refuses_outputs_that_are_inputs(tmp_path, case):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    flags = {"output is prompts": ["--output", str(prompts)], "metrics is prompts": ["--metrics", str(prompts)],
             "metrics is output": ["--output", str(tmp_path / "x.json"), "--metrics", str(tmp_path / "x.json")]}[case]
    result = cli("--prompts", str(prompts), *flags, *QUICK)
    assert_one_error_line(result)
    assert prompts.read_text() == json.dumps({"prompt": "hello"}) + "\n"
    assert sorted(os.listdir(tmp_path)) == ["p.jsonl"]


def test_cli_checks_metrics_before_decoding(tmp_path):
    result = cli("--prompt", "hello", "--metrics", str(tmp_path / "nope" / "m.json"), *QUICK)
    assert_one_error_line(result)
    assert f"--metrics {tmp_path}/nope/m.json: directory {tmp_path}/nope does not exist" in result.stderr
    assert result.stdout == ""  # nothing ran


def test_cli_with_stdout_closed_is_not_a_traceback():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "specdec.run", "--prompt", "hello", *QUICK, "--samples", "1"],
                            stderr=subprocess.PIPE, text=True, timeout=300, env=env, preexec_fn=lambda: os.close(1))
    assert result.returncode in (0, 2) and "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0 or len(result.stderr.strip().splitlines()) == 1


CTRL_C_AT_IMPORT = """
import runpy, sys
class CtrlC:  # Ctrl-C while the heavy modules load: raised when torch is imported
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
sys.meta_path.insert(0, CtrlC())
sys.argv = ["specdec.run", "--prompt", "hello", "--no-progress"]
runpy.run_module("specdec.run", run_name="__main__")
"""


def test_cli_ctrl_c_during_start_up_is_one_line():
    result = subprocess.run([sys.executable, "-c", CTRL_C_AT_IMPORT], capture_output=True, text=True, timeout=120)
    assert_one_error_line(result, code=130)
    assert result.stderr.startswith("specdec.run: interrupted (Ctrl-C)")


def test_cli_seed_overflow_reports_the_typed_value():
    result = cli("--prompt", "a", "--prompt", "b", "--temperature", "1", "--seed", str((1 << 64) - 1), *QUICK)
    assert_one_error_line(result)
    assert f"--seed {(1 << 64) - 1}" in result.stderr and str(1 << 64) not in result.stderr


def test_vocabulary_mismatch_names_the_model(tmp_path):
    from specdec import LLM

    draft = tmp_path / "draft"
    shutil.copytree(DEFAULT_DRAFT, draft)
    for name in ("tokenizer.json", "tokenizer.model"):
        os.unlink(draft / name)
    raw = json.loads((draft / "config.json").read_text())
    raw["vocab_size"] = 3000
    (draft / "config.json").write_text(json.dumps(raw))
    from safetensors.torch import load_file, save_file

    tensors = load_file(draft / "model.safetensors")
    tensors = {k: (v[:3000].clone() if v.shape[0] == 4000 else v) for k, v in tensors.items()}
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        LLM(DEFAULT_TARGET, str(draft), num_speculative_tokens=2)
    assert f"draft {draft}" in str(info.value) and "3000" in str(info.value)
