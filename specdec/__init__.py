"""specdec: batch speculative decoding that is exactly right, and fast.

    from specdec import LLM, SamplingParams
    llm = LLM(target="dir", draft="dir", method="eqspec", num_speculative_tokens=5, batch_size=8)
    outs = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=64))
"""
import importlib

# name -> module: loaded on first use (PEP 562), so that `python -m specdec.run` starts without torch and its
# main() catches a Ctrl-C during start-up
_EXPORTS = {"Engine": "engine", "RequestDelta": "engine", "LLM": "llm", "METHODS": "llm", "Outputs": "llm",
            "RunMetrics": "metrics", "RequestOutput": "request", "SamplingParams": "sampling"}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value

__all__ = ["Engine", "LLM", "METHODS", "Outputs", "RequestDelta", "RequestOutput", "RunMetrics", "SamplingParams"]
__version__ = "0.1.0"
