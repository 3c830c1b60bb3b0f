"""The user's training data (`--data FILE.jsonl`): one JSON object a line, {"prompt": "..."} (the target answers
it) or {"text": "..."} (trained on as it is); blank lines are skipped. A bad line stops the run with one line
naming the file and the line number."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class UserData:
    prompts: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts) + len(self.texts)


def read_user_data(paths: list[Path]) -> UserData:
    """The prompts and texts of every file, in order; SystemExit naming FILE:LINE on the first bad line."""
    data = UserData()
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise SystemExit(f"--data {path}: file not found") from None
        except (OSError, UnicodeDecodeError) as err:
            raise SystemExit(f"--data {path}: cannot read it ({err})") from None
        before = len(data)
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise SystemExit(f"--data {path}:{number}: not JSON ({err})") from None
            if not isinstance(record, dict) or len({"prompt", "text"} & set(record)) != 1:
                raise SystemExit(f'--data {path}:{number}: expected an object with one of "prompt" or "text"')
            kind = "prompt" if "prompt" in record else "text"
            value = record[kind]
            if not isinstance(value, str) or not value.strip():
                raise SystemExit(f'--data {path}:{number}: "{kind}" must be a non-empty string')
            (data.prompts if kind == "prompt" else data.texts).append(value)
        if len(data) == before:
            raise SystemExit(f"--data {path}: no prompt or text in it")
    return data
