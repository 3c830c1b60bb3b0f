"""`LLM`: the user-facing engine. Loads (or wraps) a target and a draft model, checks that they share a
vocabulary, and runs a strategy over any number of prompts, `batch_size` rows at a time."""
from __future__ import annotations

import os
import time

import torch

from specdec.models import CheckpointError, load_model, load_tokenizer
from specdec.models.numerics import packing_pays, set_batch_invariant

from .batch import DecodeContext
from .devices import engine_device
from .autok import make_chooser, prepare_chooser
from .metrics import PhaseTimer, RunMetrics
from .options import AUTO, EngineOptions
from .request import Request, RequestOutput
from .sampling import SamplingParams, request_generator
from .strategies import SPECULATIVE, STRATEGIES

METHODS = tuple(STRATEGIES)


class Outputs(list):
    """The per-request outputs, in prompt order, with the run's aggregate `metrics`."""

    metrics: RunMetrics


def _has_tokenizer(path) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.model", "tokenizer.json"))


class LLM:
    """Batch speculative decoding engine.

    target, draft: checkpoint directories (Llama/Vicuna, Qwen3, GLM-4 in HF format) or model objects
    meeting the protocol of docs/api.md. method: "ar", "eqspec", "ragged" or "exspec".
    num_speculative_tokens: k, or "auto" (default): chosen every step, 0..max_speculative_tokens, from
    measured costs and each request's acceptance (docs/design.md).
    check_invariants: verify invariants I2-I6 after every step (default: $SPECDEC_CHECK_INVARIANTS).
    compile: torch.compile the forwards (docs/api.md says what it costs). profile: time the phases of
    every step (synchronises; off by default). The other options: docs/api.md.
    """

    def __init__(self, target, draft=None, method: str = "eqspec", num_speculative_tokens: int | str = "auto",
                 batch_size: int = 8, dtype="float32", device="auto", check_invariants: bool | None = None,
                 kernel_backend: str | None = None, window_size: int = 48, max_wait_steps: int = 8,
                 tokenizer=None, check_weights: bool = False, max_speculative_tokens: int = 8,
                 realign_cost_per_row: float = 0.175, fold_shift: bool = False, compile: bool | None = None,
                 profile: bool = False, cost_cache: str | None = None, batch_invariant: bool = False,
                 packed_weights: bool | None = None):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        speculative = method in SPECULATIVE
        k = num_speculative_tokens
        if speculative and k != AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"num_speculative_tokens must be 'auto' or an int >= 1 for method {method!r}, got {k!r}")
        if speculative and draft is None:
            raise ValueError(f"method {method!r} needs a draft model (draft=...)")
        if method == "exspec" and window_size < batch_size:
            raise ValueError(f"window_size ({window_size}) must be >= batch_size ({batch_size})")
        if check_invariants is None:
            check_invariants = os.environ.get("SPECDEC_CHECK_INVARIANTS", "0") not in ("", "0")
        if compile is None:  # $SPECDEC_COMPILE=1 runs a whole test suite compiled (docs/api.md)
            compile = os.environ.get("SPECDEC_COMPILE", "0") not in ("", "0")
        self.options = EngineOptions(
            num_speculative_tokens=k if speculative else 0, max_speculative_tokens=max_speculative_tokens,
            window_size=window_size, max_wait_steps=max_wait_steps, realign_cost_per_row=realign_cost_per_row,
            fold_shift=fold_shift, kernel_backend=kernel_backend, compile=compile, profile=profile,
            check_invariants=check_invariants, cost_cache=cost_cache)
        self.method = method
        self.k = self.options.num_speculative_tokens  # an int, or "auto"
        self.batch_size = batch_size
        self.device = engine_device(device, target)  # "auto": CUDA when available (or the model object's), else CPU
        self.check_weights = check_weights  # scan loaded weights for NaN/inf (load_model(check_weights=...))

        self._specs = (target, draft)  # what the models were loaded from (auto k caches costs per checkpoint)
        self.target = self._model(target, dtype)
        self.draft = self._model(draft, dtype) if speculative else None
        if batch_invariant:  # models/numerics.py; False leaves model objects as they are
            for model in (self.target, self.draft):
                if model is not None:
                    set_batch_invariant(model, True)
        for model in (self.target, self.draft):
            self._set_packed_weights(model, packed_weights)
        self.tokenizer = tokenizer
        if tokenizer is None and isinstance(target, (str, os.PathLike)) and _has_tokenizer(target):
            self.tokenizer = load_tokenizer(target)
        self.vocab_size = self._shared_vocab(target, draft)
        eos = set(getattr(getattr(self.target, "cfg", None), "eos_token_ids", ()) or ())
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.max_context = min(self._max_positions(m) for m in (self.target, self.draft) if m is not None)
        self.target_name = f"target {target}" if isinstance(target, (str, os.PathLike)) else "the target model"
        if compile:
            self._compile()
        self.chooser = make_chooser(self) if self.options.auto_k else None

    def _compile(self) -> None:
        """torch.compile the forwards of our own models (CUDA: with CUDA graphs, "reduce-overhead")."""
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        for model in (self.target, self.draft):
            if model is None:
                continue
            if not hasattr(model, "compile_forward"):
                raise ValueError(f"compile=True needs models with compile_forward(); {type(model).__name__} has none")
            model.compile_forward(mode)

    @staticmethod
    def _set_packed_weights(model, packed: bool | None) -> None:
        """`packed_weights`: None (default) packs the float32 CPU linear weights of models where
        `numerics.packing_pays`; True requires a model with `packed_linear`; False leaves it off."""
        if model is None:
            return
        if not hasattr(model, "packed_linear"):
            if packed:
                raise ValueError(f"packed_weights=True needs models with a `packed_linear` attribute; "
                                 f"{type(model).__name__} has none")
            return
        if packed is None:
            packed = packing_pays(model)
        if packed or model.packed_linear:
            model.packed_linear = bool(packed)

    def _model(self, spec, dtype):
        if isinstance(spec, (str, os.PathLike)):
            return load_model(spec, dtype=dtype, device=self.device, check_weights=self.check_weights)
        for attr in ("forward", "new_cache", "vocab_size"):
            if not hasattr(spec, attr):
                raise TypeError(f"model object {type(spec).__name__} lacks {attr!r} (see docs/api.md, model protocol)")
        return spec

    @staticmethod
    def _max_positions(model) -> int:
        cfg = getattr(model, "cfg", None)
        return getattr(cfg, "max_position_embeddings", None) or getattr(model, "max_position_embeddings", 1 << 30)

    def _shared_vocab(self, target_spec, draft_spec) -> int:
        """The vocabulary both models speak; refuse different tokenizers (padded embeddings are fine)."""
        sizes = [self.target.vocab_size] + ([self.draft.vocab_size] if self.draft is not None else [])
        if self.draft is None:
            return sizes[0]
        paths = [p for p in (target_spec, draft_spec) if isinstance(p, (str, os.PathLike))]
        with_tok = [p for p in paths if _has_tokenizer(p)]
        if len(with_tok) == 2:
            t_tok, d_tok = self.tokenizer or load_tokenizer(target_spec), load_tokenizer(draft_spec)
            if t_tok.fingerprint() != d_tok.fingerprint():
                raise CheckpointError(
                    f"draft {draft_spec} and target {target_spec} have different tokenizers/vocabularies "
                    f"(vocab sizes {d_tok.vocab_size} and {t_tok.vocab_size}); speculative decoding needs one vocabulary")
            if t_tok.vocab_size > min(sizes):
                raise CheckpointError(f"tokenizer has {t_tok.vocab_size} ids but a model's embedding has only {min(sizes)}")
            return t_tok.vocab_size
        if sizes[0] != sizes[1]:
            raise CheckpointError(
                f"draft and target vocabulary sizes differ ({sizes[1]} vs {sizes[0]}) and no tokenizers are "
                f"available to show they agree")
        return sizes[0]

    # ------------------------------------------------------------------ generate
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, index: int = 0) -> None:
        """Raise ValueError, naming the prompt's `index`, if this request cannot run: an empty prompt, ids
        outside the vocabulary, or prompt + max_tokens + k_max + 1 beyond the context."""
        ids = prompt_token_ids
        if not ids:
            raise ValueError(f"prompt {index} is empty (no tokens)")
        if max(ids) >= self.vocab_size or min(ids) < 0:
            raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {self.vocab_size})")
        need = len(ids) + params.max_tokens + self.options.k_max + 1
        if need > self.max_context:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; with max_tokens={params.max_tokens} and k={self.options.k_max} "
                f"it needs {need} positions but the model context is {self.max_context}")

    def _requests(self, prompts, prompt_token_ids, sampling_params):
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts (text) or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: the target directory has none; pass prompt_token_ids")
            prompt_token_ids = [self.tokenizer.encode(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompt_token_ids)
        if len(sampling_params) != len(prompt_token_ids):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompt_token_ids)} prompts")
        requests = []
        for i, (ids, params) in enumerate(zip(prompt_token_ids, sampling_params)):
            ids = [int(t) for t in ids]
            self.check_request(ids, params, i)
            stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            generator = None if params.greedy else request_generator(params.seed, self.device)
            requests.append(Request(i, ids, params, frozenset(stop), generator))
        return prompts, requests

    @torch.inference_mode()
    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None, use_tqdm: bool = False,
                 on_output=None, batch_size: int | None = None) -> Outputs:
        """Generate for every prompt (text, or token ids via `prompt_token_ids`); outputs in prompt order.

        `on_output(RequestOutput)`, if given, is called for each request as soon as it finishes (in
        completion order), e.g. to stream results to a file while the rest is still decoding.
        `batch_size` overrides the LLM's for this call (e.g. to compare batch 1 with the same models)."""
        batch_size = self.batch_size if batch_size is None else batch_size
        if batch_size < 1 or (self.method == "exspec" and self.options.window_size < batch_size):
            raise ValueError(f"batch_size must be >= 1 (and <= window_size for exspec), got {batch_size}")
        prompts, requests = self._requests(prompts, prompt_token_ids, sampling_params)
        metrics = RunMetrics(self.method, batch_size, num_requests=len(requests))
        if self.chooser is not None and requests:
            prepare_chooser(self, self.chooser, requests, *self._specs, batch_size)
            self.chooser.start_run()
        ctx = DecodeContext(self.target, self.draft, self.options, self.vocab_size, self.device, metrics,
                            PhaseTimer(metrics, self.device, self.options.profile), self.target_name, self.chooser)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc=f"{self.method} requests", unit="req", dynamic_ncols=True)

        outputs_by_index: dict[int, RequestOutput] = {}

        def progress(finished: list[Request]) -> None:
            for r in finished:
                text = self.tokenizer.decode(r.output_ids) if self.tokenizer is not None else None
                out = outputs_by_index[r.index] = RequestOutput.from_request(r, prompts[r.index] if prompts else None, text)
                if on_output is not None:
                    on_output(out)
            if bar is not None and finished:
                bar.update(len(finished))
                bar.set_postfix(tokens=metrics.generated_tokens, refresh=False)

        t0 = time.perf_counter()
        for r in requests:
            r.submitted_at = t0
        STRATEGIES[self.method].run(ctx, requests, batch_size, progress)
        metrics.wall_time_s = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        outputs = Outputs()
        for r in requests:
            metrics.latencies_s.append((r.finished_at or t0) - r.submitted_at)
            metrics.ttfts_s.append((r.first_token_at or t0) - r.submitted_at)
            outputs.append(outputs_by_index[r.index])
        outputs.metrics = metrics
        return outputs
