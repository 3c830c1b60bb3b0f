"""Reading prompt files: `.txt` (one prompt per line), `.jsonl` (`prompt` field, or SpecBench `turns`)."""
from __future__ import annotations

import json
import os

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEFAULT_PROMPTS = os.path.join(ASSETS, "prompts.txt")
DEFAULT_TARGET = os.path.join(ASSETS, "default_pair", "target")
DEFAULT_DRAFT = os.path.join(ASSETS, "default_pair", "draft")


def read_prompts(path: str) -> list[str]:
    """Prompts from a file. `.txt`: one per line, blank lines and lines starting with `#` skipped, the two
    characters `\\n` stand for a newline. `.jsonl`: one JSON object per line with a `prompt` string or a
    `turns` list (SpecBench's question.jsonl; the first turn is used). Errors name the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: prompt file not found")
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read prompt file ({err})") from None
    jsonl = path.endswith((".jsonl", ".json"))
    for number, line in enumerate(lines, 1):
        if not line.strip() or (not jsonl and line.startswith("#")):
            continue
        if not jsonl:
            prompts.append(line.replace("\\n", "\n"))
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}:{number}: not valid JSON") from None
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record, dict) and isinstance(record.get("turns"), list) and record["turns"]:
            if not isinstance(record["turns"][0], str):
                raise ValueError(f"{path}:{number}: 'turns'[0] must be a string, got "
                                 f"{type(record['turns'][0]).__name__}")
            prompts.append(record["turns"][0])
        else:
            raise ValueError(f"{path}:{number}: expected a 'prompt' string or a non-empty 'turns' list")
    if not prompts:
        raise ValueError(f"{path}: no prompts in file")
    return prompts
