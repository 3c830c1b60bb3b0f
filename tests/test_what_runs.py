"""Issue 57, "say what runs": the run summary names the forward and the CPU kernel's instruction set (tests/
test_cli.py); the server's /metrics says the same as `specdec_forward_info`; the kernel's scalar variant warns once
a process, with what it costs; --batch-invariant's help says what it does for a quantized target."""
import pytest

from specdec import LLM, summary
from specdec.kernels import qmm_cpu


@pytest.fixture(scope="module")
def quantized(llama_pair):
    return LLM(llama_pair[0], method="ar", quantize="int4", check_invariants=False)


def test_forward_info_names_the_forward_and_the_kernels_instruction_set(quantized, llama_pair):
    native = qmm_cpu.available()
    info = summary.forward_info(quantized.target)
    assert info == ({"forward": "native", "isa": qmm_cpu.host_isa(), "reason": ""} if native else
                    {"forward": "torch", "isa": "unavailable", "reason": quantized.target.native_reason})
    assert summary.forward_summary(quantized.target) == (f"native forward ({qmm_cpu.host_isa()})" if native
                                                         else f"torch forward ({quantized.target.native_reason})")
    float_model = LLM(llama_pair[0], method="ar", check_invariants=False).target
    info = summary.forward_info(float_model)  # float weights: no quantized kernel, and why not native
    assert info["forward"] == "torch" and info["isa"] == "none" and info["reason"], info


def test_metrics_name_the_forward(quantized):
    """/metrics of specdec.serve: an info metric with the forward, the kernel's instruction set and why not native."""
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    from fastapi.testclient import TestClient

    from specdec.serve.app import build_app

    app = build_app(quantized, quantized.engine(), "tiny", max_waiting=4)
    with TestClient(app) as client:
        text = client.get("/metrics").text
    info = summary.forward_info(quantized.target)
    line = (f'specdec_forward_info{{forward="{info["forward"]}",isa="{info["isa"]}",reason="{info["reason"]}"}} 1.0')
    assert line in text.splitlines(), text
    assert "# HELP specdec_forward_info What runs the target's steps" in text


def test_the_scalar_kernel_warns_once_with_its_cost(quantized, llama_pair, monkeypatch, capsys):
    monkeypatch.setattr(qmm_cpu, "host_isa", lambda: "scalar")
    monkeypatch.setattr(summary, "_scalar_warned", False)
    capsys.readouterr()
    LLM(llama_pair[0], method="ar", quantize="int4", check_invariants=False)
    LLM(llama_pair[0], method="ar", quantize="int4", check_invariants=False)  # once a process
    err = capsys.readouterr().err
    assert err.count("specdec: warning: the CPU quantized kernel runs its scalar variant here (no AVX2): ~65x "
                     "slower than AVX2: 7.9 ms against 0.12 ms for an 896 x 4864 Q4_K matrix at one row\n") == 1, err
    monkeypatch.setattr(summary, "_scalar_warned", False)
    LLM(llama_pair[0], method="ar", check_invariants=False)  # float weights do not use the kernel: no warning
    monkeypatch.setattr(qmm_cpu, "host_isa", lambda: "avx2")
    assert not summary.warn_scalar_kernel([quantized.target])
    assert "warning" not in capsys.readouterr().err


def test_batch_invariant_help_says_what_it_does_for_a_quantized_target():
    from specdec.run import build_parser

    text = " ".join(build_parser().format_help().split())
    assert ("A quantized target (a GGUF as stored, or --quantize) always runs batch-invariant numerics (it loads "
            "with them on; its native forward is invariant by construction): off changes nothing there") in text
