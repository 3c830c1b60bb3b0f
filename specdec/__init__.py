"""specdec: batch speculative decoding that is exactly right, and fast.

    from specdec import LLM, SamplingParams
    llm = LLM(target="dir", draft="dir", method="eqspec", num_speculative_tokens=5, batch_size=8)
    outs = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=64))
"""
from .llm import LLM, METHODS, Outputs
from .metrics import RunMetrics
from .request import RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "METHODS", "Outputs", "RequestOutput", "RunMetrics", "SamplingParams"]
__version__ = "0.1.0"
