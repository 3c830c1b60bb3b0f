"""Issue 12: bad values are refused naming the argument, and `--output` never destroys, half-writes or loses.

In-process and fast (no model is loaded here): SamplingParams and CLI sampling flags (defect 6), device
resolution (defect 5), SpecBench `turns` (defect 9), and the `--output` writer (defects 2-4) on every kind of
path: regular files, symlinks, devices, FIFOs, directories, failures before, during and after the run
(interrupts: tests/test_reliability2.py). tests/test_cli.py drives the same cases end to end through
`python -m specdec.run`.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import threading
from types import SimpleNamespace

import pytest
import torch

from specdec import SamplingParams
from specdec.devices import engine_device, resolve_device
from specdec.output import JsonlOutput, OutputError
from specdec.prompts import read_prompts
from specdec.run import error_line, main

from cli_helpers import fake_output, hidden, jsonl_indexes as indexes

# --------------------------------------------------------------------------- SamplingParams (defect 6)


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.5), ("temperature", "1"),
    ("top_k", -5), ("top_k", -1), ("top_k", 2.5), ("top_p", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("max_tokens", 0), ("max_tokens", 3.0), ("max_tokens", True), ("seed", 1.5), ("seed", 1 << 64),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]), ("stop_token_ids", 7), ("ignore_eos", "yes"),
])
def test_sampling_params_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**{field: value})


def test_sampling_params_accept_the_edges():
    p = SamplingParams(max_tokens=1, temperature=0, top_k=0, top_p=1, seed=-(1 << 63), stop_token_ids=[0, 5])
    assert p.greedy and p.stop_token_ids == (0, 5)
    assert not SamplingParams(temperature=1e-6, top_k=1, top_p=1e-9, seed=(1 << 64) - 1).greedy


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "nan"], "--temperature must be >= 0 and finite"),
    (["--temperature", "inf"], "--temperature must be >= 0 and finite"),
    (["--top-k", "-5"], "--top-k must be >= 0"),
    (["--top-p", "nan"], "--top-p must be in (0, 1]"),
])
def test_cli_sampling_flags_are_refused_before_loading(capsys, flags, message):
    assert main([*flags, "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- devices (defect 5)


def test_auto_device_is_cuda_when_present_else_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert engine_device("auto", object()) == torch.device("cpu")  # a model object without .device stays put
    assert engine_device("auto", SimpleNamespace(device=torch.device("cpu"))) == torch.device("cpu")


@pytest.mark.parametrize("spec,message", [
    ("gpu0", "'gpu0' is not a device name"), ("meta", "'meta': not available or not supported"),
    ("cuda:99", "'cuda:99'"), (3, "must be a device name"),
])
def test_bad_devices_say_what_is_available(spec, message):
    if spec == "cuda:99" and not torch.cuda.is_available():
        message = "no CUDA GPU is available"
    with pytest.raises(ValueError, match=message) as info:
        resolve_device(spec)
    assert "available here: cpu" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "gpu0"])
def test_cli_device_errors_are_one_line(capsys, device):
    assert main(["--device", device, "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert f"--device {device!r}" in err and "available here: cpu" in err


def test_llm_refuses_a_bad_device_before_loading():
    from specdec import LLM

    with pytest.raises(ValueError, match="device 'gpu0'"):
        LLM("/nonexistent/target", "/nonexistent/draft", device="gpu0")


# --------------------------------------------------------------------------- prompt files (defect 9)


def test_specbench_turns_must_be_strings(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"turns": ["fine"]}) + "\n" + json.dumps({"turns": [{"content": "x"}, "y"]}) + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: 'turns'\\[0\\] must be a string, got dict"):
        read_prompts(str(path))
    path.write_text(json.dumps({"turns": ["a", 3]}) + "\n")
    assert read_prompts(str(path)) == ["a"]  # only the first turn is used


# --------------------------------------------------------------------------- --output (defects 2, 3, 4)


OUTPUTS = [fake_output(i) for i in range(4)]
PROMPTS = [f"p{i}" for i in range(4)]


def run_output(path, completion_order=(2, 0, 3, 1), fail_after: int | None = None):
    """Drive a JsonlOutput as the CLI does: stream in completion order, then commit (or fail part-way)."""
    with JsonlOutput.open(str(path)) as out:
        for n, i in enumerate(completion_order):
            if fail_after is not None and n == fail_after:
                raise RuntimeError("decoding failed")
            out.write(OUTPUTS[i], PROMPTS[i])
        out.commit(OUTPUTS, PROMPTS)
    return out


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield 0o640
    os.umask(previous)


def test_regular_file_in_prompt_order_with_the_umask(tmp_path, umask_027):
    path = tmp_path / "out.jsonl"
    out = run_output(path)
    assert indexes(path) == [0, 1, 2, 3] and json.loads(path.read_text().splitlines()[1])["prompt"] == "p1"
    assert stat.S_IMODE(os.stat(path).st_mode) == umask_027  # not mkstemp's 0600
    assert hidden(tmp_path) == [] and not out.stream


def test_replacing_a_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    os.chmod(path, 0o604)
    run_output(path)
    assert indexes(path) == [0, 1, 2, 3] and stat.S_IMODE(os.stat(path).st_mode) == 0o604


@pytest.mark.parametrize("exists", [True, False])
def test_symlink_is_written_through(tmp_path, exists):
    target_dir = tmp_path / "data"
    target_dir.mkdir()
    target, link = target_dir / "real.jsonl", tmp_path / "link.jsonl"
    if exists:
        target.write_text("old\n")
    os.symlink(target, link)
    run_output(link)
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert indexes(target) == [0, 1, 2, 3]
    assert hidden(tmp_path) == [] and hidden(target_dir) == []


def test_dev_null_is_streamed_to_and_stays_a_device():
    out = run_output("/dev/null")
    assert out.stream and stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_dev_full_fails_with_one_clear_error_and_stays_a_device():
    with pytest.raises(OutputError, match=r"^--output /dev/full: cannot write \(No space left on device\)$"):
        run_output("/dev/full")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_fifo_receives_lines_in_completion_order(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.extend(open(fifo, encoding="utf-8").read().splitlines()))
    reader.start()
    run_output(fifo)
    reader.join(timeout=10)
    assert [json.loads(line)["index"] for line in received] == [2, 0, 3, 1]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_standard_stream_paths_share_the_open_descriptor(tmp_path):
    """/dev/fd/N writes through descriptor N itself (its offset, no truncation), as /dev/stdout does for 1."""
    path = tmp_path / "shared.txt"
    with open(path, "w", encoding="utf-8") as f:
        f.write("before\n")
        f.flush()
        out = run_output(f"/dev/fd/{f.fileno()}")
        f.write("after\n")
    lines = path.read_text().splitlines()
    assert out.stream and lines[0] == "before" and lines[-1] == "after"
    assert [json.loads(line)["index"] for line in lines[1:-1]] == [2, 0, 3, 1]


@pytest.mark.parametrize("case", ["directory", "missing directory", "parent is a file", "cannot create"])
def test_unusable_outputs_are_refused_up_front(tmp_path, case):
    (tmp_path / "file").write_text("x")
    path, message = {
        "directory": (tmp_path, "is a directory"),
        "missing directory": (tmp_path / "nope" / "out.jsonl", "does not exist"),
        "parent is a file": (tmp_path / "file" / "out.jsonl", "Not a directory"),
        "cannot create": ("/proc/specdec-out.jsonl", "cannot create the output"),
    }[case]
    with pytest.raises(OutputError, match=f"^--output {path}: .*{message}"):
        JsonlOutput.open(str(path))
    assert hidden(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_refused_up_front(tmp_path):
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(OutputError, match="cannot create the output.*[Pp]ermission"):
            JsonlOutput.open(str(tmp_path / "out.jsonl"))
    finally:
        os.chmod(tmp_path, 0o700)


def test_late_failure_keeps_the_partial_file_and_says_where(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("previous run\n")
    with pytest.raises(RuntimeError) as info:
        run_output(path, fail_after=2)
    partial, lines = info.value.specdec_partial
    assert os.path.dirname(partial) == str(tmp_path) and os.path.basename(partial).startswith(".out.jsonl.")
    assert indexes(partial) == [2, 0] and lines == 2
    assert path.read_text() == "previous run\n"  # the target is untouched
    assert error_line(info.value).endswith(f"the 2 request(s) finished before the error are in {partial}")


def test_failure_before_any_request_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        run_output(tmp_path / "out.jsonl", fail_after=0)
    assert os.listdir(tmp_path) == []


def test_failing_final_write_keeps_the_complete_partial(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OutputError, match="cannot write .No space left on device") as info:
        run_output(path)
    partial, lines = info.value.specdec_partial
    assert sorted(indexes(partial)) == [0, 1, 2, 3] and lines == 4
    assert hidden(tmp_path) == [os.path.basename(partial)] and not path.exists()  # the second temporary is gone
