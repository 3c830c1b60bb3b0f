"""docs/examples/hf_adapter.py: a transformers model behind the documented protocol decodes exactly."""
import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "hf_adapter.py"


def test_hf_adapter_example_is_exact():
    results = runpy.run_path(str(EXAMPLE))["main"]()
    for method, (identical, acceptance) in results.items():
        assert identical, method
        assert 0 < acceptance < 1, method
