"""Training text for a draft of a real chat model, written by the model itself (no outside data).

Two passes of the target through `specdec.LLM` (method "ar", our own engine):
1. questions: a chat turn asks the target, sampled with a per-request seed, to write one question of a
   category about a subject (a fixed list below, none taken from SpecBench);
2. answers: each question, chat-templated, answered greedily: the target's own greedy continuation, which is
   what the draft must predict at evaluation.

Cached in one .pt file keyed by everything the texts depend on (the target file's sha256, the settings).
"""
from __future__ import annotations

import itertools
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .records import file_sha256

CATEGORIES = (
    "writing", "creative story", "poem", "role-play", "logical reasoning", "math word problem", "arithmetic",
    "Python coding", "JavaScript coding", "SQL", "algorithm", "information extraction", "physics", "chemistry",
    "biology", "history", "geography", "economics", "philosophy", "psychology", "translation into French",
    "summarization", "general knowledge", "advice", "health", "cooking", "travel", "business email",
    "comparison", "definition", "step-by-step instructions", "opinion",
)
SUBJECTS = (
    "the ocean", "a small town", "space travel", "climate", "a job interview", "friendship", "computers",
    "music", "sports", "gardening", "the Roman Empire", "electricity", "money", "a birthday party", "robots",
    "trains", "the human heart", "volcanoes", "chess", "coffee", "a library", "rain", "social media", "bees",
    "a museum", "the moon", "exercise", "sleep", "a startup", "recycling", "mountains", "a hospital",
    "photography", "the internet", "languages", "a city park", "taxes", "dinosaurs", "a river", "schools",
)
QUESTION_REQUEST = ("Write one {category} question or task that a user might ask an AI assistant, about {subject}. "
                    "Reply with the question only.")


@dataclass(frozen=True)
class SelfDataConfig:
    questions: int = 1200
    question_tokens: int = 48
    question_temperature: float = 0.9
    answer_tokens: int = 128
    batch_size: int = 64
    seed: int = 0


def question_requests(n: int, seed: int) -> list[str]:
    """n distinct (category, subject) requests in a seeded order (cycling when n exceeds the grid)."""
    grid = list(itertools.product(CATEGORIES, SUBJECTS))
    random.Random(seed).shuffle(grid)
    return [QUESTION_REQUEST.format(category=c, subject=s) for c, s in itertools.islice(itertools.cycle(grid), n)]


def clean_question(text: str) -> str | None:
    """The question the target wrote (the quoted part when it quoted one), or None when it wrote nothing usable."""
    quoted = re.findall(r'"([^"]{12,})', text)
    text = (quoted[0] if quoted else text).strip()
    if text.lower().startswith(("question:", "task:", "user:")):
        text = text.split(":", 1)[1].strip()
    return text if len(text) >= 12 else None


def answer(llm, questions: list[str], answer_tokens: int, log=print) -> dict:
    """Each question chat-templated and answered greedily by the target: {"sequences": [[prompt ids + answer
    ids], ...], "prompt_lengths": [...]}."""
    from specdec import SamplingParams

    t0 = time.time()
    prompts = llm.encode(questions, chat=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=answer_tokens),
                        use_tqdm=True)
    generated = sum(len(o.token_ids) for o in outs)
    seconds = max(time.time() - t0, 1e-9)
    log(f"answers: {generated:,} answer tokens of {len(questions)} prompts ({seconds:.0f} s, "
        f"{generated / seconds:.0f} tok/s)")
    return {"sequences": [p + list(o.token_ids) for p, o in zip(prompts, outs)],
            "prompt_lengths": [len(p) for p in prompts]}


def generate(target: Path, cfg: SelfDataConfig, log=print) -> dict:
    """{"questions": [...], "sequences": [[prompt ids + greedy answer ids], ...], "prompt_lengths": [...],
    "seconds": ...}; the questions are the target's own."""
    from specdec import LLM, SamplingParams

    llm = LLM(str(target), method="ar", batch_size=cfg.batch_size)
    t0 = time.time()
    asks = question_requests(cfg.questions, cfg.seed)
    params = [SamplingParams(max_tokens=cfg.question_tokens, temperature=cfg.question_temperature, top_p=0.95,
                             seed=cfg.seed * 1_000_003 + i) for i in range(len(asks))]
    outs = llm.generate(prompt_token_ids=llm.encode(asks, chat=True), sampling_params=params, use_tqdm=True)
    questions = list(dict.fromkeys(q for q in (clean_question(o.text) for o in outs) if q))
    log(f"self-data: {len(questions)} usable questions of {len(asks)} ({time.time() - t0:.0f} s)")
    return {"questions": questions, **answer(llm, questions, cfg.answer_tokens, log), "seconds": time.time() - t0}


def keyed_cache(path: Path, key: dict, make, what: str, log=print) -> dict:
    """What `path` holds when it was made with `key`; otherwise `make()` with the key added, saved to `path`
    atomically (a temporary file renamed into place) and returned."""
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        if saved.get("key") == key:
            log(f"{what}: loaded {path}")
            return saved
        log(f"{what}: {path} was made with other settings; making it again")
    data = make() | {"key": key}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return data


def load_or_generate(target: Path, cfg: SelfDataConfig, cache: Path, log=print) -> dict:
    key = {"target_sha256": file_sha256(str(target), 64), **asdict(cfg)}
    return keyed_cache(cache, key, lambda: generate(target, cfg, log), "self-data", log)
