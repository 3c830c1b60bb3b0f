"""Reading prompt files: `.txt` (one prompt per line), `.jsonl` (`prompt` field, or SpecBench `turns`)."""
from __future__ import annotations

import json
import os

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEFAULT_PROMPTS = os.path.join(ASSETS, "prompts.txt")
DEFAULT_TARGET = os.path.join(ASSETS, "default_pair", "target")
DEFAULT_DRAFT = os.path.join(ASSETS, "default_pair", "draft")


def parse_prompt_line(line: str, path: str, number: int, jsonl: bool) -> str | None:
    """One line of a prompt file -> its prompt, or None for a line that holds none. The rules of
    `specdec.prompts.read_prompts`: `.txt` skips blank and `#` lines and turns the two characters `\\n`
    into a newline; `.jsonl` takes a `prompt` string or the first of a `turns` list."""
    if not line.strip() or (not jsonl and line.startswith("#")):
        return None
    if not jsonl:
        return line.replace("\\n", "\n")
    try:
        record = json.loads(line)
    except ValueError:
        raise ValueError(f"{path}:{number}: not valid JSON") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    if isinstance(record, dict) and isinstance(record.get("turns"), list) and record["turns"]:
        if not isinstance(record["turns"][0], str):
            raise ValueError(f"{path}:{number}: 'turns'[0] must be a string, got {type(record['turns'][0]).__name__}")
        return record["turns"][0]
    raise ValueError(f"{path}:{number}: expected a 'prompt' string or a non-empty 'turns' list")


def iter_prompt_file(path: str, offset: int = 0, number: int = 1):
    """Yield (byte offset, line number, prompt) for each prompt of the file from byte `offset` (the start of
    line `number`) on, one line in memory at a time. Lines end at \\n (a \\r before it is dropped)."""
    jsonl = path.endswith((".jsonl", ".json"))
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            for raw in f:
                try:
                    line = raw.decode("utf-8").rstrip("\n").rstrip("\r")
                except UnicodeDecodeError:
                    raise ValueError(f"{path}:{number}: not valid UTF-8") from None
                prompt = parse_prompt_line(line, path, number, jsonl)
                if prompt is not None:
                    yield offset, number, prompt
                offset += len(raw)
                number += 1
    except OSError as err:
        raise ValueError(f"{path}: cannot read prompt file ({err.strerror or err})") from None


def read_prompts(path: str) -> list[str]:
    """Prompts from a file. `.txt`: one per line, blank lines and lines starting with `#` skipped, the two
    characters `\\n` stand for a newline. `.jsonl`: one JSON object per line with a `prompt` string or a
    `turns` list (SpecBench's question.jsonl; the first turn is used). Errors name the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: prompt file not found")
    prompts = [prompt for _, _, prompt in iter_prompt_file(path)]
    if not prompts:
        raise ValueError(f"{path}: no prompts in file")
    return prompts
