"""Reading prompt files: `.txt` (one prompt per line), `.jsonl` (`prompt` field, or SpecBench `turns`)."""
from __future__ import annotations

import json
import os
import stat

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEFAULT_PROMPTS = os.path.join(ASSETS, "prompts.txt")
DEFAULT_TARGET = os.path.join(ASSETS, "default_pair", "target")
DEFAULT_DRAFT = os.path.join(ASSETS, "default_pair", "draft")


def parse_prompt_line(line: str, path: str, number: int, jsonl: bool) -> str | None:
    """One line of a prompt file -> its prompt, or None for a line that holds none. The rules of
    `specdec.prompts.read_prompts`: `.txt` skips blank and `#` lines and turns the two characters `\\n`
    into a newline; `.jsonl` takes a `prompt` string or the first of a `turns` list. A prompt must be valid
    Unicode (a JSON escape can spell a lone surrogate, which cannot be encoded)."""
    if not line.strip() or (not jsonl and line.startswith("#")):
        return None
    if not jsonl:
        return line.replace("\\n", "\n")
    try:
        record = json.loads(line)
    except ValueError:
        raise ValueError(f"{path}:{number}: not valid JSON") from None
    except RecursionError:
        raise ValueError(f"{path}:{number}: JSON nested too deeply to read") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return _unicode_text(record["prompt"], path, number, "'prompt'")
    if isinstance(record, dict) and isinstance(record.get("turns"), list) and record["turns"]:
        if not isinstance(record["turns"][0], str):
            raise ValueError(f"{path}:{number}: 'turns'[0] must be a string, got {type(record['turns'][0]).__name__}")
        return _unicode_text(record["turns"][0], path, number, "'turns'[0]")
    raise ValueError(f"{path}:{number}: expected a 'prompt' string or a non-empty 'turns' list")


def _unicode_text(text: str, path: str, number: int, field: str) -> str:
    """`text` if it is valid Unicode; JSON's `\\uD800`-style escapes can spell lone surrogates, which are not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{path}:{number}: {field} holds a lone surrogate {text[err.start]!r} at character "
                         f"{err.start} (not valid Unicode text)") from None
    return text


FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_prompt_file(path: str) -> None:
    """Refuse, naming what it is, a prompt path that is not a regular file (prompt files are read twice
    by the distributed runner and by offset, so a pipe, a terminal or /dev/stdin cannot serve)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: prompt file not found") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read prompt file ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in FILE_KINDS if test(mode)), "not a regular file")
        raise ValueError(f"{path}: is {kind}, not a prompt file; give a regular .txt or .jsonl file")


def iter_prompt_file(path: str, offset: int = 0, number: int = 1):
    """Yield (byte offset, line number, prompt) for each prompt of the file from byte `offset` (the start of
    line `number`) on, one line in memory at a time. Lines end at \\n (a \\r before it is dropped)."""
    jsonl = path.endswith((".jsonl", ".json"))
    check_prompt_file(path)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            for raw in f:
                try:
                    line = raw.decode("utf-8").rstrip("\n").rstrip("\r")
                except UnicodeDecodeError:
                    raise ValueError(f"{path}:{number}: not valid UTF-8") from None
                if offset == 0:
                    line = line.removeprefix("\ufeff")  # a UTF-8 byte order mark is not part of the first prompt
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
    prompts = [prompt for _, _, prompt in iter_prompt_file(path)]
    if not prompts:
        raise ValueError(f"{path}: no prompts in file")
    return prompts


CHAT_TEMPLATE_HELP = ("a Jinja chat template for {what}, replacing the checkpoint's (needed when it has none, as the "
                      "embedded pair)")


def read_chat_template(path: str) -> str:
    """The text of a --chat-template FILE (ValueError naming the flag and the file when it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot read it: {e}") from None


def set_chat_template(tokenizer, path: str) -> None:
    """Replace the tokenizer's chat template with the file's (rendered by the same sandboxed Jinja)."""
    tokenizer.set_chat_template(read_chat_template(path))
