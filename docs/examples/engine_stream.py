"""Feeding requests to a running Engine: two start, more join while it steps, one is aborted, and tokens
stream out as they are made. Runs offline on the embedded default pair:

    python docs/examples/engine_stream.py
"""
from specdec import LLM, SamplingParams
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET


def main() -> dict:
    llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, method="ragged", num_speculative_tokens="auto", batch_size=4)
    engine = llm.engine()
    greedy = SamplingParams(max_tokens=32)
    engine.add_request("def fibonacci(n):", greedy, request_id="fib")
    engine.add_request("import os\n", SamplingParams(max_tokens=32, temperature=0.8, seed=7), request_id="os")
    later = {2: ("class Stack:", "stack"), 5: ("def read_json(path):", "json"), 6: ("for i in range(", "loop")}
    texts, reasons, step = {}, {}, 0
    while engine.has_unfinished() or later:
        if step in later:  # a request arrives while the others are decoding
            prompt, rid = later.pop(step)
            engine.add_request(prompt, greedy, request_id=rid)
        if step == 8:
            engine.abort("loop")  # its row is freed at the next step; the others go on, unchanged
        for delta in engine.step():  # one step: new tokens and text per request
            texts[delta.request_id] = texts.get(delta.request_id, "") + delta.text
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
                print(f"[{delta.request_id}] {delta.finish_reason}: {texts[delta.request_id]!r}")
        step += 1
    print(f"{engine.metrics.generated_tokens} tokens, acceptance {engine.metrics.acceptance_rate:.0%}")
    return {"texts": texts, "reasons": reasons}


if __name__ == "__main__":
    main()
