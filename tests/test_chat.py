"""`python -m specdec.chat` (and `python -m specdec.run --chat` without prompts), issue 58: an interactive chat
driven through a pseudo-terminal as a user's terminal drives it -- answers streamed, the conversation kept
(the second turn prefills only its new tokens, counted by the prefix cache's hits), Ctrl-C mid-answer stops
the answer and keeps the session, /reset clears the conversation, Ctrl-D ends it. A tiny llama pair with a
word-level tokenizer and a chat template of words (tests/checkpoints.py)."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from checkpoints import make_pair, write_wordlevel_tokenizer
from terminal import Terminal

WORDS = ["<unk>", "<s>", "</s>", "system", "user", "assistant"] + [f"w{i}" for i in range(125)]  # 131 ids
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}")
STATS = re.compile(r"\((\d+) prompt tokens: (\d+) from the prefix cache, (\d+) prefilled; (\d+) tokens in ")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    target, draft = make_pair("llama", root, max_position_embeddings=2048)
    for d in (target, draft):
        write_wordlevel_tokenizer(d, WORDS)
    template = root / "chat.jinja"
    template.write_text(TEMPLATE)
    return target, draft, str(template)


def turn(term: Terminal, message: str, interrupt: bool = False) -> tuple[str, tuple[int, int, int, int]]:
    """Send one message; (the answer as shown, (prompt tokens, from the cache, prefilled, answer tokens)).
    `interrupt`: press Ctrl-C as soon as the answer's first text shows."""
    at = term.send(message + "\n")
    echo = term.expect(re.escape(message) + r"\n", at)  # the terminal echoes the line typed
    if interrupt:
        term.expect(r"\S", echo.end())  # the answer's first text: it streams
        term.send("\x03")
    stats = term.expect(STATS.pattern, echo.end())
    term.expect(r"\n> $", stats.end())  # the next prompt: the session goes on
    return term.seen[echo.end():stats.start()].strip(), tuple(map(int, stats.groups()))


def test_chat_through_a_terminal(chat_pair):
    """Three turns streamed, the conversation kept in the prefix cache (turn 2 prefills only its new tokens),
    /reset clears it (the same message gets the first turn's prompt and answer again), Ctrl-C mid-answer stops
    that answer and keeps the session (at the prompt it clears the line), Ctrl-D ends it (exit 0)."""
    target, draft, template = chat_pair
    term = Terminal(["-m", "specdec.chat", "--target", target, "--draft", draft, "--chat-template", template,
                     "--threads", "1", "--stats", "-k", "3"])
    try:
        term.expect(r"/reset starts a new conversation.*\n> $", 0, timeout=180)
        first, (p1, hit1, fill1, n1) = turn(term, "w1 w2 w3")
        assert n1 >= 20 and (hit1, fill1) == (0, p1), (first, p1, hit1, fill1, n1)  # nothing cached yet
        second, (p2, hit2, fill2, n2) = turn(term, "w4 w5")
        # the conversation so far (turn 1's prompt and answer) comes from the cache; prefilled: the new message
        # and the template's words around it, the answer's last token (never fed) and the EOS the template
        # writes again, at most
        new = p2 - (p1 + n1)
        assert hit2 >= p1 + n1 - 2 and fill2 <= new + 2 and fill2 < p2 // 4, (p1, n1, p2, hit2, fill2)
        third, (p3, hit3, fill3, n3) = turn(term, "w6")
        assert p3 > p2 + n2 - 2 and hit3 >= p2 + n2 - 2, (p2, n2, p3, hit3)  # the whole conversation, kept
        for answer in (first, second, third):  # each answer was shown, before its stats line
            assert re.fullmatch(r"(\S+ ?)+( \[.*\])?", answer), answer

        at = term.send("/reset\n")
        term.expect(r"\(a new conversation\)\n> $", at)
        again, (p4, hit4, _, n4) = turn(term, "w1 w2 w3")
        assert (p4, n4, again) == (p1, n1, first)  # a new conversation: the first turn's prompt and answer

        at = term.send("/reset\n")
        term.expect(r"\(a new conversation\)\n> $", at)
        # "w1" is answered with ~2,000 tokens (seconds): stopped at its first text, shown before it ended (streamed)
        stopped, (p5, _, _, n5) = turn(term, "w1", interrupt=True)
        assert stopped.endswith("[stopped]") and n5 < 1000, (stopped, n5)
        after, (p6, hit6, _, n6) = turn(term, "w4 w5")  # the session survived Ctrl-C, with what was said
        assert n6 > 0 and p6 > p5 + n5 - 2 and hit6 >= p5, (p5, n5, p6, hit6)

        # Ctrl-C at the prompt: the line typed so far is dropped, a fresh prompt. (Pressed once the line shows: a
        # ^C that lands while readline is still setting up the terminal waits for the next key, in Python's
        # readline module itself)
        at = term.send("w7 w8")
        term.expect(r"w7 w8$", at)
        term.send("\x03")
        term.expect(r"\n> $", at)
        assert STATS.search(term.seen, at) is None  # nothing was asked

        at = term.send("\x04")  # Ctrl-D at the prompt
        assert term.wait() == 0, term.seen[at:]
    finally:
        term.close()


def test_run_chat_without_prompts_is_the_same_chat(chat_pair):
    """`specdec.run --chat` without --prompt/--prompts reads messages (here from a pipe) as specdec.chat does,
    --system included; --max-tokens caps each answer and says so."""
    target, draft, template = chat_pair
    result = subprocess.run(
        [sys.executable, "-m", "specdec.run", "--target", target, "--draft", draft, "--chat", "--chat-template",
         template, "--system", "w9", "--max-tokens", "5", "--threads", "1", "-k", "2"],
        input="w1 w2\n/help\nw3\n/exit\n", capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr
    answers = re.findall(r"(?:^|> )((?:\S+ ){5}\[--max-tokens 5 reached\])", result.stdout)
    assert len(answers) == 2, result.stdout
    assert "/reset: start a new conversation" in result.stdout  # /help
    assert "specdec.run: /reset starts a new conversation" in result.stderr


@pytest.mark.parametrize("argv, words", [
    ([], "no chat template in the checkpoint; give --chat-template FILE"),  # the embedded pair has none
    (["--chat-template", "/nonexistent.jinja"], "--chat-template /nonexistent.jinja: cannot read it"),
    (["--max-tokens", "100000"], "--max-tokens 100000: the model's context is"),
])
def test_chat_refusals_are_one_line(argv, words):
    result = subprocess.run([sys.executable, "-m", "specdec.chat", *argv], input="", capture_output=True, text=True,
                            timeout=300, env=ENV)
    assert result.returncode == 2 and words in result.stderr, result.stderr
    assert result.stderr.startswith("specdec.chat: error: ") and "Traceback" not in result.stderr, result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("specdec.chat")]) == 1


def test_the_conversation_continues_from_the_answers_tokens(chat_pair):
    """A turn's prompt ids are the last prompt's, the answer's as generated (a final EOS dropped: the template
    writes the turn's end), then the rest of the template's rendering encoded; a template that rewrites the
    history falls back to encoding the whole prompt."""
    from specdec.chat import Conversation
    from specdec.models import load_tokenizer

    target, _, _ = chat_pair
    tok = load_tokenizer(target)
    tok.set_chat_template(TEMPLATE)
    conversation = Conversation(tok, "w9", eos_token_ids={2})
    messages, text, ids = conversation.prompt("w1 w2")
    assert text == "system w9 user w1 w2 assistant " and ids == tok.encode(text, add_special_tokens=False)
    conversation.answered(messages, text, ids, [10, 11, 2], "w4 w5")  # as generated: ends with EOS
    messages, text2, ids2 = conversation.prompt("w3")
    assert text2 == "system w9 user w1 w2 assistant w4 w5 user w3 assistant "
    assert ids2 == ids + [10, 11] + tok.encode(" user w3 assistant ", add_special_tokens=False)
    conversation.reset()
    assert conversation.prompt("w1 w2")[2] == ids
    tok.set_chat_template("{% for m in messages[-1:] %}{{ m['role'] }} {{ m['content'] }} {% endfor %}")
    conversation.answered(messages, text2, ids2, [12], "w6")
    assert conversation.prompt("w7")[2] == tok.encode("user w7 ", add_special_tokens=False)


@pytest.mark.parametrize("argv, words", [
    (["--system", "be brief", "--prompt", "x"], "--system goes with --chat"),
    (["--chat-template", "t.jinja", "--prompt", "x"], "--chat-template goes with --chat"),
    (["--chat", "--output", "o.jsonl"], "--output needs prompts (--prompt/--prompts): --chat without them is the "
                                        "interactive chat"),
    (["--chat", "--compare-ar"], "--compare-ar needs prompts"),
    (["--chat", "--chat-template", "/nonexistent.jinja", "--prompt", "x"],
     "--chat-template /nonexistent.jinja: cannot read it"),
])
def test_run_refuses_chat_flags_that_mean_nothing_in_one_line(argv, words, capsys, tmp_path, monkeypatch):
    """Before anything loads: flags of the chat without --chat, and the interactive chat with flags that need
    prompts."""
    from specdec.run import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdec.run: error: {words}") and err.count("\n") == 1, err
    assert not (tmp_path / "o.jsonl").exists()


def test_run_chat_answers_until_eos_by_default(chat_pair, tmp_path, capsys):
    """`specdec.run --chat --prompt` without --max-tokens: each answer until EOS, capped by the context (it was
    64 tokens, cutting a real model's answers mid-sentence); without --chat the default stays 64."""
    from specdec.run import main

    target, draft, template = chat_pair
    out = tmp_path / "out.jsonl"
    base = ["--target", target, "--draft", draft, "--prompt", "w1 w2 w3", "--threads", "1", "--no-progress",
            "--samples", "0", "--output", str(out)]
    assert main([*base, "--chat", "--chat-template", template]) == 0
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["finish_reason"] == "stop" and len(record["token_ids"]) > 64, record
    assert main(base) == 0
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["finish_reason"] == "length" and len(record["token_ids"]) == 64, record


class Keys:
    """A chat's screen (`write`) and keyboard (`read`): the lines to type (an exception is raised instead of
    read), and a Ctrl-C (SIGINT to this process) pressed when the screen first shows `ctrl_c_on`."""

    def __init__(self, lines, ctrl_c_on=None):
        self.lines, self.ctrl_c_on, self.shown = list(lines), ctrl_c_on, ""

    def write(self, text):
        self.shown += text
        if self.ctrl_c_on is not None and re.search(self.ctrl_c_on, self.shown):
            self.ctrl_c_on = None
            os.kill(os.getpid(), signal.SIGINT)  # handled at once (the main thread), as a terminal's ^C

    def flush(self):
        pass

    def read(self, prompt):
        self.write(prompt)
        line = self.lines.pop(0)
        if isinstance(line, type) and issubclass(line, BaseException):
            raise line()
        return line


@pytest.mark.parametrize("when", ["mid-answer", "after the answer", "at the prompt"])
def test_ctrl_c_never_ends_the_session(chat_pair, when):
    """In process: Ctrl-C mid-answer stops it ([stopped]); one that lands after the answer ended (while its
    stats are written) stops nothing and raises nothing; at the prompt it gives a fresh prompt. The session
    goes on each time, and ends with Ctrl-D (0)."""
    from types import SimpleNamespace

    from specdec import LLM
    from specdec.chat import Chat

    target, draft, template = chat_pair
    llm = LLM(target, draft, batch_size=1, prefix_cache_gb=0.01, num_speculative_tokens=2, check_invariants=False)
    llm.tokenizer.set_chat_template(TEMPLATE)
    args = SimpleNamespace(system=None, max_tokens=None, temperature=0.0, top_k=0, top_p=1.0, seed=None, stats=True)
    # "w1" is answered at length (~2,000 tokens): Ctrl-C as its first word shows; "w4 w5" briefly
    lines, ctrl_c_on = {"mid-answer": (["w1", "w4 w5", EOFError], r"> w\d+ "),
                        "after the answer": (["w4 w5", "w6", EOFError], r"tokens in "),
                        "at the prompt": (["w4 w5", KeyboardInterrupt, "w6", EOFError], None)}[when]
    keys = Keys(lines, ctrl_c_on)
    chat = Chat(llm, args, out=keys)
    assert chat.loop(read=keys.read) == 0
    answers = re.findall(r"\n?(.*)\n\((\d+) prompt tokens", keys.shown)
    assert len(answers) == 2, keys.shown
    assert answers[0][0].endswith("[stopped]") == (when == "mid-answer"), keys.shown
    assert int(answers[1][1]) > int(answers[0][1]), keys.shown  # the second turn holds the first


@pytest.mark.real_model
def test_a_real_model_chat_prefills_only_each_new_message():
    """SmolLM2-135M-Instruct as stored, its own chat template: two turns; the second finds the first's prompt
    and answer (all but the answer's last token, never fed) in the prefix cache."""
    from real_model import real_gguf

    result = subprocess.run([sys.executable, "-m", "specdec.chat", "--target", real_gguf(), "--stats"],
                            input="Hi! Who are you?\nWhat is 2+2?\n/exit\n", capture_output=True, text=True,
                            timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr
    (p1, hit1, _, n1), (p2, hit2, fill2, _) = [tuple(map(int, m)) for m in STATS.findall(result.stdout)]
    assert hit1 == 0 and hit2 >= p1 + n1 - 2 and fill2 <= p2 - (p1 + n1) + 2, result.stdout
