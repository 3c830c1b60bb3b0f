"""`LLM`: the user-facing engine. Loads (or wraps) a target and a draft model, checks that they share a
vocabulary, and runs a strategy over any number of prompts, `batch_size` rows at a time."""
from __future__ import annotations

import numbers
import os
import sys

import torch

from specdec.models import CheckpointError, is_gguf, load_model, load_tokenizer
from specdec.models.feature_draft import is_feature_draft, load_feature_draft
from specdec.models.numerics import packing_pays, set_batch_invariant

from . import bi_mode, preflight
from .autok import make_chooser
from .devices import engine_device
from .drafts import shipped_draft
from .engine import Engine
from .metrics import RunMetrics
from .options import AUTO, LOOKUPS, Options, positions_needed
from .memory import HEADROOM, available_bytes
from .prefix_cache import GIB, PrefixCache, budget_bytes
from .prompts import DEFAULT_DRAFT, DEFAULT_TARGET
from .proposers import CombinedProposer, ModelProposer, NgramProposer, SuffixProposer, SuffixStore
from .sampling import SamplingParams
from .startup import StartupMeasurement
from .summary import warn_scalar_kernel
from .schedulers import SCHEDULERS, SPECULATIVE

METHODS = tuple(SCHEDULERS)
DEFAULT_LOOKUP = "suffix"  # the drafter of a target with no draft given and none shipped (docs/benchmarks/lookup.md)


class Outputs(list):
    """The per-request outputs, in prompt order, with the run's aggregate `metrics`. A prompt asked with
    `SamplingParams(n=...)` has n consecutive outputs, choices 0..n-1 (`output.index` is the prompt's,
    `output.choice` the completion's); with n = 1 everywhere, outputs[i] is prompt i's."""

    metrics: RunMetrics

    def by_prompt(self) -> list[list]:
        """The outputs grouped per prompt: [prompt 0's choices, prompt 1's, ...]."""
        groups: list[list] = []
        for out in self:
            if out.choice == 0:
                groups.append([])
            groups[-1].append(out)
        return groups


def model_name(spec, role: str) -> str:
    """How a message names a model: `draft PATH`, or `the draft model` for a model object."""
    return f"{role} {os.fspath(spec)}" if isinstance(spec, (str, os.PathLike)) else f"the {role} model"


def _has_tokenizer(path) -> bool:
    if is_gguf(path):  # the tokenizer is in the file's metadata
        return True
    return any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.model", "tokenizer.json"))


class LLM:
    """Batch speculative decoding engine.

    target, draft: checkpoint directories (Llama/Vicuna, Qwen3, GLM-4 in HF format), GGUF files, or model
    objects meeting the protocol of docs/api.md; `LLM()` without a target runs the embedded default pair (the
    toy 15.7M/3.6M pair `python -m specdec.run` runs without flags); `draft` may also name a drafter that needs
    no model: "ngram" (prompt lookup) or "suffix" (suffix decoding). Without a draft, a speculative method uses
    the draft specdec ships for the target, or else "suffix".
    options: an `Options` (specdec/options.py), and/or its fields by keyword (`method="ragged", batch_size=4`,
    replacing those of `options`): how the models are loaded (dtype, device, quantize, batch_invariant, ...),
    how speculation runs (method, num_speculative_tokens, lookup, ...), the cache and scheduler (batch_size,
    prefix_cache_gb, prefill_chunk, ...); each field's help says what it does, and docs/api.md lists them.
    tokenizer: a tokenizer object instead of the target's. proposer: bring your own drafter: a callable
    returning a new proposer (the protocol of specdec/proposers, docs/api.md) for each Engine; it drafts
    without a model (`draft` must be None).
    """

    def __init__(self, target=None, draft=None, options: Options | None = None, *, tokenizer=None, proposer=None,
                 **kwargs):
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"LLM's third argument is an Options, got {options!r}: give the others by keyword, e.g. "
                            f"LLM(target, draft, method='eqspec', num_speculative_tokens=4)")
        self.options = Options.build(options, **kwargs)  # every option checked here, once
        load, spec, sched = self.options.load, self.options.speculation, self.options.scheduler
        speculative = spec.speculative
        self.device = engine_device(load.device, target)  # "auto": CUDA when available (or the model object's)
        budget = None if sched.prefix_cache_gb is None else budget_bytes(sched.prefix_cache_gb)
        free = None if budget is None else available_bytes(self.device)
        if free is not None and budget > HEADROOM * free:
            raise ValueError(f"prefix_cache_gb (--prefix-cache-gb) {sched.prefix_cache_gb:g} GiB is more than the "
                             f"{HEADROOM * free / GIB:.1f} GiB that can be used on {self.device}")
        # the K/V of prefixes seen before, shared by every Engine (and server request) of this LLM
        self.prefix_cache = None if budget is None else PrefixCache(budget)
        if target is None:  # the embedded default pair, as the command line runs it without --target
            if draft is not None:
                raise ValueError("draft= needs target= (or give neither: the embedded default pair)")
            target = DEFAULT_TARGET
            draft = DEFAULT_DRAFT if speculative and proposer is None else None
        preflight.check_vocabularies(target, draft if speculative else None)  # from the files, before any weights
        if (slow := preflight.dtype_warning(load.dtype, self.device)) is not None:
            print(slow, file=sys.stderr)
        self.target = self._model(target, load.quantize)
        if speculative and draft is None and proposer is None:
            draft = shipped_draft(self.target)
            if draft is None:
                draft = DEFAULT_LOOKUP
                print(f"specdec: no draft given and none shipped for {model_name(target, 'target')}; drafting with "
                      f"{DEFAULT_LOOKUP!r} (from text already seen; auto k stops it where it does not pay)",
                      file=sys.stderr)
            else:
                print(f"specdec: no draft given; using the draft shipped for this target ({draft.name}, recognised "
                      f"by the target's fingerprint)", file=sys.stderr)
        self.drafter = None  # "ngram" / "suffix" when the drafts need no model
        self.proposer_factory = proposer
        if proposer is not None:
            if not callable(proposer) or draft is not None or not speculative:
                raise ValueError("proposer= takes a callable returning a new proposer, for a speculative method "
                                 "without draft=")
            self.drafter = "custom"
        if speculative and isinstance(draft, str) and draft in LOOKUPS:
            self.drafter, draft = draft, None
        if spec.lookup in LOOKUPS and (not speculative or draft is None):
            raise ValueError("lookup= goes beside a draft model (draft=DIR); to draft from lookups alone pass "
                             f"draft={spec.lookup!r}")
        # beside a draft model, a lookup's drafts first (free: no draft step); "auto": suffix beside a model
        self.lookup = spec.lookup if spec.lookup in LOOKUPS else None
        if spec.lookup == AUTO and speculative and draft is not None and self.drafter is None:
            self.lookup = DEFAULT_LOOKUP
        # the cross-request part of "suffix", shared by every Engine (and server request) of this LLM
        self.suffix_store = SuffixStore(spec.suffix_store_tokens) if spec.suffix_store_tokens else None
        self.specs = (target, draft)  # what the models were loaded from (auto k caches costs per checkpoint)
        self.draft = self._model(draft, load.draft_quantize) if speculative and draft is not None else None
        warn_scalar_kernel((self.target, self.draft))  # once a process: the kernel's scalar variant and its cost
        # the start-up measurement (threads, batch-invariant cost, auto k's costs): one warm-up, one cache file
        self.startup = StartupMeasurement(load.cost_cache)
        # True / False / "auto" (specdec/bi_mode.py: on for speculative methods on CUDA where it costs <= 1.15x)
        self.batch_invariant_choice = bi_mode.choose(
            load.batch_invariant, self.target, self.draft, self.device, speculative, sched.batch_size, spec.k,
            spec.max_speculative_tokens, load.compile, target, measurement=self.startup)
        bi_mode.announce(self.batch_invariant_choice)
        if self.batch_invariant_choice.on:  # models/numerics.py; off leaves model objects as they are
            for model in (self.target, self.draft):
                if model is not None:
                    set_batch_invariant(model, True)
        elif getattr(self.draft, "quantize", None):  # only the target's numbers must be invariant
            self.draft.batch_invariant = False
        for source, model in zip(self.specs, (self.target, self.draft)):
            if isinstance(source, (str, os.PathLike)) or load.packed_weights is not None:  # None: an object stays
                self._set_packed_weights(model, load.packed_weights)
            if model is not None and load.native_forward is not None:
                self._set_native_forward(model, load.native_forward)
        self.tokenizer = tokenizer
        if tokenizer is None and isinstance(target, (str, os.PathLike)) and _has_tokenizer(target):
            self.tokenizer = load_tokenizer(target)
        # the draft head's token subset where it is restricted (specdec/draft_vocab.py), else None
        self.draft_vocab = None if self.draft is None else self._restrict_draft_head(spec.draft_vocab, draft)
        self.vocab_size = self._shared_vocab(target, draft)
        eos = set(getattr(getattr(self.target, "cfg", None), "eos_token_ids", ()) or ())
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.max_context = min(self._max_positions(m) for m in (self.target, self.draft) if m is not None)
        self.target_name = f"target {target}" if isinstance(target, (str, os.PathLike)) else "the target model"
        if load.compile:
            self._compile()
        self._use_graphs(load.cuda_graphs, load.compile)
        self.chooser = make_chooser(self) if spec.auto_k else None

    @property
    def method(self) -> str:
        return self.options.speculation.method

    @property
    def batch_size(self) -> int:
        return self.options.scheduler.batch_size

    def _compile(self) -> None:
        """torch.compile the forwards of our own models (inductor's kernels; CUDA graphs are models/graphs.py's)."""
        for model in (self.target, self.draft):
            if model is None:
                continue
            if not hasattr(model, "compile_forward"):
                raise ValueError(f"compile=True needs models with compile_forward(); {type(model).__name__} has none")
            model.compile_forward(None)

    def _use_graphs(self, cuda_graphs: bool | None, compile: bool) -> None:
        """`cuda_graphs`: None (default) runs the steps of our own models as CUDA graph replays on CUDA (not
        with `compile`: one or the other); True asks for it (refused off CUDA)."""
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this LLM runs on {self.device}")
        if cuda_graphs and compile:
            raise ValueError("cuda_graphs=True and compile=True: the graphs capture the eager forward; choose one")
        if cuda_graphs is None and self.device.type != "cuda":
            return  # a model object keeps what its owner set
        on = not compile if cuda_graphs is None else cuda_graphs
        for model in (self.target, self.draft):
            if model is not None and hasattr(model, "use_graphs"):
                model.use_graphs(on)
            elif on and cuda_graphs:
                raise ValueError(f"cuda_graphs=True needs models with use_graphs(); {type(model).__name__} has none")

    def _restrict_draft_head(self, size, draft_spec):
        """`draft_vocab`: restrict the draft's head to the `size` most frequent tokens of the count shipped for its
        tokenizer (the target's: the vocabularies are checked equal; specdec/draft_vocab.py); "auto": DEFAULT_SIZE
        where one ships and the draft was loaded from a file (a model object given directly stays as it is). Returns
        the subset's ids (None: the full head)."""
        from specdec import draft_vocab

        if size == 0 or (size == AUTO and not isinstance(draft_spec, (str, os.PathLike))):
            return None
        if not hasattr(self.draft, "restrict_head"):
            if size == AUTO:
                return None
            raise ValueError(f"draft_vocab={size}: the draft ({type(self.draft).__name__}) has no restrict_head")
        tokenizer = self.tokenizer
        if tokenizer is None and isinstance(draft_spec, (str, os.PathLike)) and _has_tokenizer(draft_spec):
            tokenizer = load_tokenizer(draft_spec)
        ids = draft_vocab.subset(tokenizer, draft_vocab.DEFAULT_SIZE if size == AUTO else size,
                                 self.draft.vocab_size)
        if ids is None:
            if size != AUTO and size < self.draft.vocab_size:
                raise ValueError(f"draft_vocab={size}: no token count ships for the draft's tokenizer "
                                 f"(python -m specdec.draft_vocab build --model DRAFT makes one)")
            return None
        self.draft.restrict_head(ids)
        return ids

    @staticmethod
    def _set_native_forward(model, native: bool) -> None:
        """`native_forward`: False runs the torch forward; True requires the native one (models/native.py)."""
        if not hasattr(model, "native_forward"):
            if native:
                raise ValueError(f"native_forward=True needs our Transformer; {type(model).__name__} has none")
            return
        model.native_forward = native
        if native and model.native is None:
            raise ValueError(f"native_forward=True: this model cannot run the native forward: {model.native_reason}")

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

    def _model(self, spec, quantize=None):
        if isinstance(spec, (str, os.PathLike)) and is_feature_draft(spec):  # it borrows the target's tensors
            return load_feature_draft(spec, self.target)
        if isinstance(spec, (str, os.PathLike)):
            return load_model(spec, dtype=self.options.load.dtype, device=self.device,
                              check_weights=self.options.load.check_weights, quantize=quantize)
        if quantize is not None and getattr(spec, "quantize", None) != quantize:
            raise ValueError(f"quantize={quantize!r} applies to checkpoints the LLM loads; this model object is "
                             f"{getattr(spec, 'quantize', None) or 'not quantized'} (load it with "
                             f"specdec.models.load_model(path, quantize={quantize!r}))")
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
                small = (target_spec, "target") if sizes[0] == min(sizes) else (draft_spec, "draft")
                raise CheckpointError(f"{model_name(*small)}: its embedding has {min(sizes)} rows, but the tokenizer of "
                                      f"{model_name(target_spec, 'target')} has {t_tok.vocab_size} ids")
            return t_tok.vocab_size
        if sizes[0] != sizes[1]:
            raise CheckpointError(
                f"{model_name(draft_spec, 'draft')} has a vocabulary of {sizes[1]} ids and "
                f"{model_name(target_spec, 'target')} one of {sizes[0]}, and no tokenizers are available to show "
                f"they agree; speculative decoding needs one vocabulary")
        return sizes[0]

    # ------------------------------------------------------------------ generate
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, index: int = 0,
                      name: str | None = None) -> None:
        """Raise ValueError, naming the request (`name`, default "prompt {index}"), if it cannot run: an empty
        prompt, ids outside the vocabulary, or prompt + max_tokens + k_max + 1 beyond the context."""
        ids, name = prompt_token_ids, name or f"prompt {index}"
        if not ids:
            raise ValueError(f"{name} is empty (no tokens)")
        if max(ids) >= self.vocab_size or min(ids) < 0:
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {self.vocab_size})")
        need = positions_needed(len(ids), params.max_tokens, self.options.speculation.k_max)
        if need > self.max_context:
            raise ValueError(
                f"{name} has {len(ids)} token{'' if len(ids) == 1 else 's'}; with max_tokens={params.max_tokens} and "
                f"k={self.options.speculation.k_max} "
                f"it needs {need} positions but the model context is {self.max_context}")

    def prompt_ids(self, prompt, name: str = "prompt") -> list[int]:
        """A prompt as token ids: text is encoded with the tokenizer; a sequence must hold integer ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: the target has none; pass token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
            raise TypeError(f"{name} must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{name} has a token id that is not an integer: {t!r}")
        return [int(t) for t in ids]

    def encode(self, prompts: list[str], chat: bool = False) -> list[list[int]]:
        """Token ids of text prompts; `chat` wraps each in the checkpoint's chat template as a user turn."""
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer: the target has none; pass token ids")
        if not chat:
            return [self.tokenizer.encode(p) for p in prompts]
        return [self.tokenizer.encode(self.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                      add_special_tokens=False) for p in prompts]

    def _lookup_proposer(self, kind: str):
        if kind == "ngram":
            return NgramProposer(self.options.speculation.ngram_min, self.options.speculation.ngram_max)
        return SuffixProposer(self.suffix_store)

    def new_proposer(self):
        """A proposer for one Engine (per-row state is the Engine's own); None for AR."""
        if self.method not in SPECULATIVE:
            return None
        if self.proposer_factory is not None:
            proposer = self.proposer_factory()
            for attr in ("plan", "propose", "observe", "release", "name", "uses_draft_model"):
                if not hasattr(proposer, attr):
                    raise TypeError(f"proposer {type(proposer).__name__} lacks {attr!r} (docs/api.md, proposers)")
            if proposer.uses_draft_model:
                raise TypeError(f"proposer {type(proposer).__name__}: a proposer brought with proposer= drafts "
                                f"without a model (uses_draft_model must be False)")
            return proposer
        if self.drafter is not None:
            return self._lookup_proposer(self.drafter)
        model = ModelProposer("feature" if getattr(self.draft, "reads_target_hidden", False) else "model")
        if self.lookup is None:
            return model
        return CombinedProposer(model, self._lookup_proposer(self.lookup), self.options.speculation.lookup_min_match)

    def engine(self, batch_size: int | None = None, stream_text: bool = True) -> "Engine":
        """An incremental `Engine` on this LLM's models (each engine has its own rows, caches and auto-k state;
        engines on one LLM may be stepped in turn, from one thread: they share the models).
        `stream_text=False`: each delta's text stays "" until its request finishes (nothing detokenized per step)."""
        return Engine(self, batch_size, stream_text)

    def _add_all(self, engine, prompts, prompt_token_ids, sampling_params) -> tuple[list | None, list[int]]:
        """Add every prompt to `engine` (request i is "i"); returns the prompt texts (None for token ids) and
        each prompt's number of choices (`SamplingParams.n`)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts (text) or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None:
            prompts = list(prompts)
            for i, p in enumerate(prompts):
                if not isinstance(p, str):
                    raise TypeError(f"prompt {i} must be a string, got {type(p).__name__} (token ids go in "
                                    f"prompt_token_ids)")
        items = prompts if prompts is not None else list(prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(items)
        elif isinstance(sampling_params, (str, bytes, dict)) or not hasattr(sampling_params, "__len__"):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(items):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(items)} prompts")
        for i, params in enumerate(sampling_params):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(params).__name__}")
        for item, params in zip(items, sampling_params):
            engine.add_request(item, params)
        return prompts, [params.n for params in sampling_params]

    @torch.inference_mode()
    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None, use_tqdm: bool = False,
                 on_output=None, batch_size: int | None = None) -> Outputs:
        """Generate for every prompt (text, or token ids via `prompt_token_ids`); outputs in prompt order.

        `on_output(RequestOutput)`, if given, is called for each request as soon as it finishes (in
        completion order), e.g. to stream results to a file while the rest is still decoding.
        `batch_size` overrides the LLM's for this call (e.g. to compare batch 1 with the same models).
        A prompt with `SamplingParams(n=...)` gets n consecutive outputs, its choices in order (`Outputs`).
        Runs on an `Engine`: every request added, then steps until all have finished."""
        engine = self.engine(batch_size, stream_text=False)  # only the final texts are returned
        prompts, choices = self._add_all(engine, prompts, prompt_token_ids, sampling_params)
        first = [0]  # where each prompt's choices start in the outputs
        for n in choices:
            first.append(first[-1] + n)
        total = first[-1]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"{self.method} requests", unit="req", dynamic_ncols=True)
        outputs: list = [None] * total
        while engine.has_unfinished():
            done = [d.output for d in engine.step() if d.finished]
            for out in done:
                out.prompt = prompts[out.index] if prompts else None
                outputs[first[out.index] + out.choice] = out
                if on_output is not None:
                    on_output(out)
            if bar is not None and done:
                bar.update(len(done))
                bar.set_postfix(tokens=engine.metrics.generated_tokens, refresh=False)
        if bar is not None:
            bar.close()
        result = Outputs(outputs)
        result.metrics = engine.metrics
        return result

    def stream(self, prompts=None, sampling_params=None, prompt_token_ids=None, batch_size: int | None = None):
        """Like `generate`, but yields each step's `RequestDelta`s as they are made (request i is "i")."""
        engine = self.engine(batch_size)
        self._add_all(engine, prompts, prompt_token_ids, sampling_params)
        while engine.has_unfinished():
            yield from engine.step()
