"""docs/examples/hf_adapter.py: a transformers model behind the documented protocol decodes exactly."""
import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "hf_adapter.py"


def test_hf_adapter_example_is_exact():
    results = runpy.run_path(str(EXAMPLE))["main"]()
    for method, (identical, acceptance) in results.items():
        assert identical, method
        assert 0 < acceptance < 1, method


ENGINE_EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "engine_stream.py"


def test_engine_example_streams_what_generate_returns():
    """docs/examples/engine_stream.py (docs/api.md): requests added while stepping, one aborted; the
    greedy requests' streamed text equals what `LLM.generate` returns for them."""
    from specdec import LLM, SamplingParams
    from specdec.prompts import DEFAULT_TARGET

    result = runpy.run_path(str(ENGINE_EXAMPLE))["main"]()
    assert result["reasons"]["loop"] == "abort"
    assert set(result["reasons"]) == {"fib", "os", "stack", "json", "loop"}
    prompts = {"fib": "def fibonacci(n):", "stack": "class Stack:", "json": "def read_json(path):"}
    offline = LLM(DEFAULT_TARGET, method="ar").generate(list(prompts.values()), SamplingParams(max_tokens=32))
    for rid, out in zip(prompts, offline):
        assert result["texts"][rid] == out.text, rid
