"""A draft's head restricted to the vocabulary's most frequent tokens (FR-Spec, Zhao et al. 2025): a draft step reads
its head's rows for those tokens only (the 0.5B Qwen draft's head is 37% of what its step reads), and drafts only
them. Exact: the target verifies every token, and a sampled draft is drawn from the renormalised subset
distribution, which is the distribution rejection sampling holds it to (models/transformer.py `restrict_head`).

Which tokens: a token count over a corpus, per tokenizer (by its fingerprint), shipped with the package as
`assets/draft_vocab/<fingerprint[:16]>.npz` (the ids ranked by count, their counts, and what was counted). Tokens
the corpus never showed are ranked by id (a BPE vocabulary's lower ids are its earlier, more frequent merges). The
special tokens (end of sequence, chat markers) are always in the subset.

    python -m specdec.draft_vocab build --model FILE.gguf [--generate-with DRAFT.gguf] [--out DIR]
    python -m specdec.draft_vocab coverage --model FILE.gguf --texts FILE.jsonl --sizes 8192,16384,32768

(the command line is specdec/draft_vocab/__main__.py)

`build` counts the Python standard library's sources (code and its docstrings, weighed down: one genre) and, with
--generate-with, a model's own answers to `corpus_prompts()` (instructions of every kind written for this, none of
SpecBench's, so that the benchmarks measure coverage on text the count never saw); `coverage` says what share of a
text's tokens each size covers (docs/benchmarks/draft-vocab.md).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "draft_vocab"
KEEP = 65536  # ranked ids kept in a table (larger subsets than this are not worth restricting)
# the subset a draft gets by default: within 1.4 points of the full head's acceptance on the Qwen pair
# (docs/benchmarks/draft-vocab.md: coverage, acceptance, step time by size)
DEFAULT_SIZE = 49152

# instructions of every kind (code, maths, writing, extraction, reasoning, roleplay, translation, summaries, STEM,
# humanities, chat), written for the count: none is a SpecBench prompt
DRAFT_VOCAB_PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list, with a docstring and tests.",
    "Implement a least-recently-used cache class in Python with get and put in O(1).",
    "Write a JavaScript function that debounces another function, and explain when to use it.",
    "Explain the difference between a process and a thread, with an example in C.",
    "Write a SQL query that returns the three best-selling products per month from an orders table.",
    "Write a Rust function that parses a comma-separated line into a vector of integers, handling errors.",
    "Refactor this Python loop into a list comprehension and explain the change: for x in xs: if x > 0: ys.append(x*2)",
    "Write a bash script that finds the ten largest files under a directory.",
    "Explain how binary search works and write it iteratively in Java.",
    "Write a Python class for a bank account with deposit, withdraw and a history of transactions.",
    "What is the time complexity of quicksort in the best, average and worst case? Explain why.",
    "Write a Go HTTP handler that returns the current time as JSON.",
    "Write unit tests with pytest for a function that checks whether a string is a palindrome.",
    "Explain what a closure is in Python and give two practical uses.",
    "Write a C++ function that reverses a singly linked list in place.",
    "Solve: a train leaves at 3 pm at 80 km/h, another at 4 pm at 100 km/h on the same track. When does the second "
    "catch up?",
    "Prove that the sum of the first n odd numbers is n squared.",
    "A rectangle's length is twice its width and its perimeter is 42 cm. Find its area.",
    "Compute the derivative of x^3 * ln(x) and explain each step.",
    "What is the probability of getting at least one six in four rolls of a fair die?",
    "Write a short story of about 200 words about a lighthouse keeper who finds a message in a bottle.",
    "Write a persuasive paragraph on why cities should invest in public libraries.",
    "Compose a haiku sequence about autumn in the mountains.",
    "Draft a polite email to a colleague asking to reschedule a meeting to next Tuesday.",
    "Write a product description for a lightweight waterproof hiking backpack.",
    "Summarise the main causes of the French Revolution in five bullet points.",
    "Explain photosynthesis to a ten-year-old.",
    "What are the main differences between mitosis and meiosis?",
    "Describe how vaccines train the immune system.",
    "Explain the greenhouse effect and its link to climate change.",
    "Extract every date and the event that happened on it from this text: 'The bridge opened on 4 May 1932; it was "
    "closed for repairs on 12 June 1990 and reopened on 1 March 1992.'",
    "List the countries mentioned in this sentence and their capitals: 'She flew from Kenya to Peru via Spain.'",
    "Translate into French: 'The meeting has been moved to Thursday afternoon because the manager is travelling.'",
    "Translate into German: 'Could you recommend a good restaurant near the train station?'",
    "Pretend you are a museum guide and introduce a painting of a stormy sea to a group of visitors.",
    "You are a travel agent. Suggest a three-day itinerary for Kyoto in spring.",
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
    "Three friends split a bill of 87 euros so that one pays twice as much as each of the others. Who pays what?",
    "What are the pros and cons of remote work for a small software company?",
    "Give me five tips to improve my sleep, with a short reason for each.",
    "How do I make a simple tomato sauce for pasta?",
    "Explain the rules of chess castling.",
    "What is the difference between weather and climate?",
    "Describe the water cycle in a few sentences.",
    "Explain what inflation is and how central banks try to control it.",
    "Write a limerick about a cat who learns to code.",
    "Explain the difference between supervised and unsupervised learning with examples.",
    "What is gradient descent? Give the update rule and an intuition.",
    "Write a Python script that reads a CSV file and prints the average of each numeric column.",
    "Explain Big-O notation with three examples.",
    "Write a regular expression that matches an email address and explain its parts.",
    "Describe the main features of Gothic architecture.",
    "Who was Ada Lovelace and why is she remembered?",
    "Give a short overview of the Roman Republic's government.",
    "Explain Newton's three laws of motion with everyday examples.",
    "How does a hash table handle collisions? Describe two methods.",
    "Write a function in TypeScript that groups an array of objects by a key.",
    "Explain the CAP theorem in distributed systems.",
    "What is the difference between TCP and UDP?",
    "Write a short dialogue between a customer and a barista.",
]


# ... and one instruction per (task, topic): breadth of vocabulary, in the model's own words
TASKS = ("Explain {} to a beginner.", "Write a short essay about {}.", "List five surprising facts about {}.",
         "Write a Python program related to {}, with comments.", "What are the main debates about {}?",
         "Summarise the history of {} in one paragraph.", "Write a short poem about {}.",
         "Give a step-by-step guide to getting started with {}.", "Compare two opposing views on {}.",
         "Write a dialogue between two experts discussing {}.")
TOPICS = ("the stock market", "volcanoes", "medieval castles", "machine learning", "the human heart", "jazz music",
          "renewable energy", "ancient Egypt", "chess openings", "coffee farming", "black holes", "the Olympic Games",
          "urban gardening", "cryptography", "the Renaissance", "ocean currents", "electric cars", "bread baking",
          "the immune system", "space exploration", "democracy", "honeybees", "video game design", "earthquakes",
          "the printing press", "marathon training", "quantum computing", "rainforests", "the Silk Road",
          "personal finance")


def corpus_prompts() -> list[str]:
    """What `build --generate-with` asks a model: DRAFT_VOCAB_PROMPTS, then every TASKS x TOPICS instruction."""
    return DRAFT_VOCAB_PROMPTS + [task.format(topic) for task in TASKS for topic in TOPICS]


def table_path(fingerprint: str) -> Path:
    return ASSETS / f"{fingerprint[:16]}.npz"


def ranked_ids(tokenizer) -> np.ndarray | None:
    """The tokenizer's ids ranked by the shipped count (int64 [<= KEEP]), or None where none ships for it."""
    if tokenizer is None or not hasattr(tokenizer, "fingerprint"):
        return None
    path = table_path(tokenizer.fingerprint())
    if not path.is_file():
        return None
    with np.load(path) as table:
        return table["ids"].astype(np.int64)


def special_ids(tokenizer) -> set[int]:
    """Ids a subset always keeps: end of sequence, beginning, padding and the tokenizer's other special tokens."""
    ids = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    for name in ("bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            ids.add(value)
    ids |= set(getattr(tokenizer, "special_ids", ()) or ())
    return ids


def subset(tokenizer, size: int, vocab_size: int) -> np.ndarray | None:
    """The `size` most frequent ids of the tokenizer's shipped table (and its special tokens), ascending, or None
    where no table ships or the subset would be the whole vocabulary."""
    ranked = ranked_ids(tokenizer)
    if ranked is None or size >= vocab_size:
        return None
    ranked = ranked[ranked < vocab_size]
    chosen = set(ranked[:size].tolist()) | {i for i in special_ids(tokenizer) if 0 <= i < vocab_size}
    return np.array(sorted(chosen), dtype=np.int64)


# -------------------------------------------------------------------------------------------- building
def count_tokens(tokenizer, texts) -> Counter:
    counts = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    return counts


STDLIB_WEIGHT = 0.1  # a standard-library token counts this much against a generated answer's (code is one genre)


MIN_COUNT = 1.0  # a token counted less (seen only a few times, in the standard library) is ranked by its id


def ranking(counts: dict, vocab_size: int) -> np.ndarray:
    """Every id by count (descending) where it reaches MIN_COUNT; the rest, and ties, by id (a BPE vocabulary's lower
    ids are its earlier, more frequent merges: alone they cover 94.8% of the Qwen target's SpecBench answers at
    32k; with the count, 95.9%): int64 [vocab]."""
    def score(i: int) -> float:
        n = counts.get(i, 0.0)
        return n if n >= MIN_COUNT else 0.0

    order = sorted(range(vocab_size), key=lambda i: (-score(i), i))
    return np.array(order, dtype=np.int64)


def coverage(model: str, texts: list[str], sizes: list[int]) -> dict[int, float]:
    """The share of the texts' tokens inside each subset size."""
    from specdec.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    counts = count_tokens(tokenizer, texts)
    total = sum(counts.values()) or 1
    out = {}
    for size in sizes:
        chosen = subset(tokenizer, size, 1 << 62)
        if chosen is None:
            raise SystemExit(f"specdec.draft_vocab: no table ships for {model}'s tokenizer; `build` one first")
        inside = set(chosen.tolist())
        out[size] = sum(n for i, n in counts.items() if i in inside) / total
    return out
