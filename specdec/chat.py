"""`python -m specdec.chat --target FILE [--draft FILE]`: an interactive chat in the terminal (also `python -m
specdec.run --chat` without prompts). Every engine flag of specdec.run applies.

- **Streaming.** Each answer is printed as it is made: the text of each engine step (`Engine.step`'s deltas)
  is written and flushed at once.
- **The conversation is kept**: every turn's prompt is the whole conversation through the chat template, and
  the prefix cache (`prefix_cache_gb`, on by default here) holds the K/V of the last prompt and answer, so a
  turn prefills only its new message. The prompt's token ids are the last prompt's ids, the answer's ids as
  generated (not re-encoded from its text) and the template's rendering of the rest encoded; where the
  template does not render the conversation so far as a prefix of the new prompt (one that rewrites earlier
  turns), the whole prompt is encoded, and the cache still finds what it shares.
- **Answers** run until EOS, capped by the model's context and by 2048 tokens (`--max-tokens` sets another cap).
- **Keys and commands.** Ctrl-C stops the current answer (what it said stays in the conversation) and, at the
  prompt, clears the line; Ctrl-D or `/exit` ends; `/reset` starts a new conversation (the system message stays).
  `--stats` prints after each answer its prompt tokens (from the prefix cache / prefilled) and its speed.
"""
from __future__ import annotations

from specdec.openmp import apply_threads, default_wait_policy

default_wait_policy()  # before anything imports torch

import argparse
import math
import signal
import sys
import threading
import time

from .flags import HelpFormatter, Parser, add_engine_arguments, add_threads_argument, build_llm, checkpoint_pair

COMMANDS = {"/reset": "start a new conversation", "/exit": "end (as Ctrl-D does)", "/help": "list the commands"}
CHAT_PREFIX_CACHE_GIB = 1.0  # the prefix cache's budget without --prefix-cache-gb (at most a quarter of free memory)
PROMPT = "> "


def build_parser() -> argparse.ArgumentParser:
    from .flags import add_chat_arguments, add_sampling_arguments

    p = Parser(prog="python -m specdec.chat", description="An interactive chat with a model: answers stream as they "
               "are made, the conversation is kept (each turn prefills only its new message, from the prefix cache), "
               "/reset starts over, Ctrl-C stops an answer, Ctrl-D or /exit ends. Every engine flag of "
               "python -m specdec.run applies.", formatter_class=HelpFormatter)
    add_engine_arguments(p, helps={
        "batch_size": "rows decoded together (a chat decodes one answer at a time: 1)",
        "prefix_cache_gb": f"GiB of K/V the conversation may keep (default: {CHAT_PREFIX_CACHE_GIB:g}, or a quarter of "
                           f"the memory available if that is less), so that each turn prefills only its new message"})
    add_threads_argument(p)
    add_sampling_arguments(p, "new tokens per answer at most (default: until the answer ends (EOS), capped by the "
                              "model's context and by 2048)")
    add_chat_arguments(p, "the chat")
    p.add_argument("--stats", action="store_true", help="after each answer, a line with its prompt tokens (from the "
                   "prefix cache / prefilled) and its tokens per second")
    p.set_defaults(batch_size=1)
    return p


# ------------------------------------------------------------------------------------------ the conversation
def chat_messages(system: str | None, user: str) -> list[dict]:
    """A one-turn conversation: the system message (if any) and the user's."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def chat_prompt_ids(tokenizer, messages: list[dict], flag: str = "--chat") -> list[int]:
    """The chat template's rendering of `messages` (with the generation prompt), encoded as it stands (the
    template writes any BOS itself). A template that refuses them is one line naming `flag`."""
    return tokenizer.encode(render(tokenizer, messages, flag), add_special_tokens=False)


def render(tokenizer, messages: list[dict], flag: str) -> str:
    from specdec.models import CheckpointError

    try:
        return tokenizer.apply_chat_template(messages)
    except CheckpointError as e:
        raise ValueError(f"{flag}: {e}{' (give --chat-template FILE)' if 'no chat_template' in str(e) else ''}") \
            from None


class Conversation:
    """The messages so far, and the token ids of the last prompt and its answer (what the prefix cache holds)."""

    def __init__(self, tokenizer, system: str | None, eos_token_ids=()):
        self.tokenizer, self.system, self.eos = tokenizer, system, frozenset(eos_token_ids)
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ids: list[int] | None = None  # the last prompt's ids and its answer's, as generated
        self.text: str | None = None  # their text: the last prompt as rendered, then the answer

    def prompt(self, user: str, flag: str = "--chat") -> tuple[list[dict], str, list[int]]:
        """(the messages with `user`'s, the prompt's text, its token ids): the conversation so far as its ids,
        then the template's rendering of the rest, encoded."""
        messages = self.messages + [{"role": "user", "content": user}]
        text = render(self.tokenizer, messages, flag)
        if self.ids is not None and text.startswith(self.text):
            return messages, text, self.ids + self.tokenizer.encode(text[len(self.text):], add_special_tokens=False)
        return messages, text, self.tokenizer.encode(text, add_special_tokens=False)

    def answered(self, messages: list[dict], text: str, ids: list[int], answer_ids: list[int], answer: str) -> None:
        """Keep the turn: its messages and the answer's. A final EOS is dropped from the ids: the template
        writes the turn's end itself (the same token, encoded with the next prompt)."""
        if answer_ids and answer_ids[-1] in self.eos:
            answer_ids = answer_ids[:-1]
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self.ids, self.text = ids + list(answer_ids), text + answer


# ---------------------------------------------------------------------------------------------- the loop
class StopKey:
    """Ctrl-C while an answer is made: sets a flag the loop reads between engine steps (a step is never cut
    in the middle), instead of raising in whatever the step is doing. Outside `with`, Ctrl-C raises again."""

    def __init__(self):
        self.pressed = threading.Event()

    def __enter__(self):
        self.pressed.clear()
        self.previous = signal.signal(signal.SIGINT, lambda signum, frame: self.pressed.set())
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


class Chat:
    """One chat session on an `LLM`: one engine (one row), the conversation, and the sampling flags."""

    def __init__(self, llm, args, out=None):
        self.llm, self.args = llm, args
        self.out = out or sys.stdout
        self.engine = llm.engine(batch_size=1)
        self.conversation = Conversation(llm.tokenizer, args.system, llm.eos_token_ids)
        self.turns = 0

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def command(self, line: str) -> bool | None:
        """Run a command line; False to end, True if it was a command, None if it is a message."""
        word = line.split()[0] if line.split() else ""
        if word not in COMMANDS or word != line.strip():
            return None
        if word == "/exit":
            return False
        if word == "/reset":
            self.conversation.reset()
            self.write("(a new conversation)\n")
        else:
            self.write("".join(f"  {name}: {what}\n" for name, what in COMMANDS.items()) +
                       "  Ctrl-C: stop an answer; Ctrl-D: end\n")
        return True

    def ask(self, message: str) -> None:
        """One turn: the prompt, the answer streamed, the conversation kept (an answer stopped with Ctrl-C
        keeps what it said). Ctrl-C during the turn stops the answer and never raises (a turn is never left
        half-recorded); one that lands after the answer ended stops nothing."""
        with StopKey() as key:
            self._ask(message, key)

    def _ask(self, message: str, key: StopKey) -> None:
        from specdec import SamplingParams
        from specdec.options import chat_answer_tokens, tokens_left

        messages, text, ids = self.conversation.prompt(message, "--chat-template")
        k_max = self.llm.options.speculation.k_max
        room = tokens_left(self.llm.max_context, len(ids), k_max)
        if room < 1:
            self.write(f"(the conversation has {len(ids)} tokens and the model's context is {self.llm.max_context} "
                       f"positions: nothing fits; /reset starts a new conversation)\n")
            return
        most = min(self.args.max_tokens or chat_answer_tokens(self.llm.max_context, len(ids), k_max), room)
        seed = None if self.args.seed is None else self.args.seed + self.turns
        params = SamplingParams(max_tokens=most, temperature=self.args.temperature, top_k=self.args.top_k,
                                top_p=self.args.top_p, seed=seed)
        self.turns += 1
        hits, measured = self.engine.metrics.prefix_hit_tokens, self.engine.metrics.calibration_s
        rid = self.engine.add_request(ids, params, request_id=f"turn {self.turns}")
        started, out, stopped = time.perf_counter(), None, False
        while self.engine.has_unfinished():
            if key.pressed.is_set() and not stopped:
                stopped = self.engine.abort(rid)
            for delta in self.engine.step():
                if delta.text:
                    self.write(delta.text)
                if delta.finished:
                    out = delta.output
        measured = self.engine.metrics.calibration_s - measured  # auto k's start-up measurement (a first turn)
        seconds = time.perf_counter() - started - measured
        answer = out.text or ""
        self.conversation.answered(messages, text, ids, out.token_ids, answer)
        ending = {"abort": " [stopped]", "length": f" [--max-tokens {most} reached]" if most < room else
                  " [the model's context is full: /reset starts a new conversation]"}
        self.write(ending.get(out.finish_reason, "") + "\n")
        if getattr(self.args, "stats", False):
            cached = self.engine.metrics.prefix_hit_tokens - hits
            n = len(out.token_ids)
            setup = f"; start-up measurement {measured:.2f} s, not counted" if measured >= 0.01 else ""
            self.write(f"({len(ids)} prompt tokens: {cached} from the prefix cache, {len(ids) - cached} prefilled; "
                       f"{n} tokens in {seconds:.2f} s, {n / seconds if seconds > 0 else math.inf:.1f} tokens/s"
                       f"{setup})\n")

    def loop(self, read=input) -> int:
        """Read messages until Ctrl-D or /exit; 0."""
        while True:
            try:
                line = read(PROMPT)
                if not line.strip():
                    continue
                done = self.command(line)
                if done is False:
                    return 0
                if done is None:
                    try:
                        self.ask(line)
                    except ValueError as err:  # the conversation cannot take this turn: say why, keep the session
                        self.write(f"({err})\n")
            except EOFError:
                self.write("\n")
                return 0
            except KeyboardInterrupt:  # at the prompt (or between turns): a fresh line, as a shell does
                self.write("\n")


def prefix_budget(device) -> float:
    """The chat's prefix cache in GiB: CHAT_PREFIX_CACHE_GIB, or a quarter of the memory available if less."""
    from .memory import available_bytes
    from .options import GIB

    free = available_bytes(device)
    return CHAT_PREFIX_CACHE_GIB if free is None else max(min(CHAT_PREFIX_CACHE_GIB, free / 4 / GIB), 1 / 1024)


def chat(args, program: str = "specdec.chat") -> int:
    """The interactive chat of parsed flags (specdec.chat's, or specdec.run's with --chat and no prompts).
    Raises ValueError/OSError for the caller's one error line."""
    from .devices import resolve_device
    from .preflight import check_max_tokens
    from .prompts import read_chat_template, set_chat_template
    from .flags import k_max_of
    from .summary import weights_summary

    target, draft, _ = checkpoint_pair(args)
    if args.chat_template:
        read_chat_template(args.chat_template)  # a bad file: refused before the weights load
    if args.max_tokens is not None:
        check_max_tokens(args.max_tokens, k_max_of(args), target, draft)
    device = resolve_device(args.device, name="--device")
    budget = args.prefix_cache_gb if args.prefix_cache_gb is not None else prefix_budget(device)
    llm = build_llm(args, device=device, batch_size=1, prefix_cache_gb=budget)
    if llm.tokenizer is None:
        raise ValueError(f"--target {target}: no tokenizer (tokenizer.model, tokenizer.json or GGUF tokenizer "
                         f"metadata): a chat needs one")
    if args.chat_template:
        set_chat_template(llm.tokenizer, args.chat_template)
    if llm.tokenizer.chat_template is None:
        raise ValueError(f"--target {target}: no chat template in the checkpoint; give --chat-template FILE")
    threads = apply_threads(args.threads, llm.target, llm.startup, llm.specs[0])
    session = Chat(llm, args)
    drafter = session.engine.metrics.drafter or "none (AR)"  # the engine's proposer: model, feature, suffix, ...
    print(f"{program}: {llm.target_name}: {weights_summary(llm, args)}; drafter {drafter}; {threads}", file=sys.stderr)
    print(f"{program}: /reset starts a new conversation, /exit or Ctrl-D ends, Ctrl-C stops an answer",
          file=sys.stderr, flush=True)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    return session.loop()


def main(argv=None) -> int:
    from .flags import check_sampling_flags

    try:
        args = build_parser().parse_args(argv)
        check_sampling_flags(args)
        return chat(args)
    except (ValueError, TypeError, OSError) as err:  # CheckpointError is a ValueError
        print(f"specdec.chat: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # while loading (during an answer Ctrl-C stops the answer)
        print("specdec.chat: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
