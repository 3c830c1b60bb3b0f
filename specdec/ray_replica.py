"""What runs inside Ray's workers for `python -m specdec.run --ray` (specdec.distributed drives the job):
`read_chunk`, the read task turning one chunk descriptor into its prompt rows, and `Replica`, the actor that
loads one `LLM` and decodes one block of rows per call, answering rows of `output_schema`.

Ray starts these by reference to this module. Ray's pyarrow and torch are imported inside the functions that
need them, so `python -m specdec.run` starts without them.
"""
from __future__ import annotations

import json
from dataclasses import fields

from .prompts import iter_prompt_file

METRIC_SKIP = ("method", "batch_size", "num_requests", "wall_time_s", "profiled")  # RunMetrics fields not summed


def read_chunk(row: dict) -> list[dict]:
    """Ray Data flat_map: one chunk descriptor -> its rows {index, prompt}."""
    chunk = json.loads(row["chunk"])
    if "prompts" in chunk:
        prompts = chunk["prompts"]
    else:
        prompts = []
        for _, _, prompt in iter_prompt_file(chunk["path"], chunk["offset"], chunk["line"]):
            prompts.append(prompt)
            if len(prompts) == chunk["count"]:
                break
    if len(prompts) != chunk["count"]:
        raise ValueError(f"{chunk.get('path')}: changed while being read (expected {chunk['count']} prompts "
                         f"from line {chunk.get('line')}, found {len(prompts)})")
    return [{"index": chunk["first"] + j, "prompt": p} for j, p in enumerate(prompts)]


def request_error(llm, prompt_token_ids: list[int], params, index: int) -> str | None:
    """Why `llm` would refuse this one request (empty, out of vocabulary, too long for the context), or None."""
    try:
        llm.check_request([int(t) for t in prompt_token_ids], params, index)
    except ValueError as err:
        return str(err)
    return None


def output_schema():
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    return pa.schema([("index", pa.int64()), ("prompt", pa.string()), ("text", pa.string()),
                      ("token_ids", ids), ("prompt_token_ids", ids), ("finish_reason", pa.string()),
                      ("accepted_counts", ids), ("speculative_tokens", ids), ("latency_s", pa.float64()),
                      ("time_to_first_token_s", pa.float64()),
                      ("error", pa.string()), ("block_metrics", pa.string())])


def metric_counters(metrics) -> dict:
    """The additive fields of a RunMetrics (counters and the per-phase times), as JSON-ready values."""
    out = {}
    for f in fields(metrics):
        value = getattr(metrics, f.name)
        if f.name not in METRIC_SKIP and isinstance(value, (int, float, dict)):
            out[f.name] = value
    return out


class Replica:
    """A Ray actor of the pool: loads one `LLM` when it starts, then decodes one block per call."""

    def __init__(self, llm_kwargs: dict, sampling: dict, chat: bool = False, threads: int | None = None):
        import torch

        from specdec import LLM
        from specdec.models import CheckpointError

        if threads:
            torch.set_num_threads(threads)
        self.sampling = dict(sampling)  # SamplingParams fields; "seed" is the base seed (request i: seed + i)
        self.chat = chat
        # A user error while loading (a bad checkpoint, a missing tokenizer) is raised by the first call, not
        # here: Ray reports a constructor's exception as text only, a call's as the exception itself, which
        # the driver then prints as its one-line error.
        self.setup_error = None
        try:
            self.llm = LLM(**llm_kwargs)
            if self.llm.tokenizer is None:
                raise ValueError(f"--target {llm_kwargs['target']}: no tokenizer.model or tokenizer.json, "
                                 "cannot encode text prompts")
        except (CheckpointError, ValueError, TypeError, OSError) as err:
            self.setup_error = err

    def params(self, index: int, prompt_tokens: int):
        """Request `index`'s SamplingParams; max_tokens None (--chat's default): until EOS, within the context and
        CHAT_MAX_TOKENS."""
        from specdec import SamplingParams
        from specdec.options import chat_answer_tokens

        base = self.sampling.get("seed")
        most = self.sampling.get("max_tokens") or max(1, chat_answer_tokens(self.llm.max_context, prompt_tokens,
                                                                            self.llm.options.speculation.k_max))
        return SamplingParams(**{**self.sampling, "max_tokens": most, "seed": None if base is None else base + index})

    def __call__(self, batch: dict):
        import pyarrow as pa

        if self.setup_error is not None:
            raise self.setup_error
        indices = [int(i) for i in batch["index"]]
        prompts = [str(p) for p in batch["prompt"]]
        ids = self.llm.encode(prompts, chat=self.chat)
        params = [self.params(i, len(x)) for i, x in zip(indices, ids)]
        errors = [request_error(self.llm, x, p, i) for x, p, i in zip(ids, params, indices)]
        good = [j for j, e in enumerate(errors) if e is None]
        outputs = {}
        metrics = None
        if good:
            result = self.llm.generate(prompt_token_ids=[ids[j] for j in good],
                                       sampling_params=[params[j] for j in good])
            outputs = {j: o for j, o in zip(good, result)}
            metrics = json.dumps({"counters": metric_counters(result.metrics), "wall_s": result.metrics.wall_time_s})
        rows = []
        for j, index in enumerate(indices):
            o = outputs.get(j)
            rows.append({"index": index, "prompt": prompts[j], "text": o.text if o else None,
                         "token_ids": o.token_ids if o else [], "prompt_token_ids": ids[j],
                         "finish_reason": o.finish_reason if o else None,
                         "accepted_counts": o.accepted_counts if o else [],
                         "speculative_tokens": o.speculative_tokens if o else [],
                         "latency_s": o.latency_s if o else 0.0,
                         "time_to_first_token_s": o.time_to_first_token_s if o else 0.0,
                         "error": errors[j], "block_metrics": metrics if j == 0 else None})
        return pa.Table.from_pylist(rows, schema=output_schema())
