"""`pagedkv chat` as a script and a person run it: a subprocess fed through a pipe or a
pseudo-terminal, on a seeded tiny Llama.

Answers are checked against transformers' greedy generation on prompts rendered and tokenised
by transformers; the footer's figures against the engine's caching rule, computed here on
token ids: a finished request leaves in the prefix cache every full block of its prompt and
answer but the answer's last token (whose KV is never computed), and a prompt hits the whole
blocks it shares with such a chain, leaving at least its last token to compute.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import transformers

import pagedkv
from pagedkv.cli import main
from pagedkv.commands import chat
from pagedkv.commands.sampling_args import sampling_params_from_args
from pagedkv.engine import SamplingParams
from pagedkv.tokenizer import Tokenizer

BLOCK_SIZE = 16
EOS = 2
MAX_TOKENS = 12
NUM_BLOCKS = 64
ENGINE_FLAGS = ["--num-gpu-blocks", str(NUM_BLOCKS), "--swap-space-gb", "0"]
FOOTER = re.compile(
    r"(\d+) of (\d+) prompt tokens from the prefix cache, (\d+) tokens, [\d.]+ tok/s, "
    r"(\d+) blocks held(; [a-z ]+)?"
)
IN_USE = re.compile(r"(\d+) in use, (\d+) cached for reuse")
TIMEOUT_S = 60.0

Messages = list[dict[str, str]]


@pytest.fixture(scope="module")
def oracle(zoo) -> Oracle:
    return Oracle(zoo, transformers.AutoTokenizer.from_pretrained(zoo.folder("llama")))


@pytest.fixture(scope="module")
def long_context_model(zoo, tmp_path_factory) -> Path:
    """The tiny Llama with a 16k context: an answer long enough to interrupt on any machine."""
    folder = tmp_path_factory.mktemp("long_context") / "llama"
    shutil.copytree(zoo.folder("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class Oracle:
    """transformers' rendering, tokenisation and greedy answers for the tiny Llama."""

    def __init__(self, zoo, tokenizer) -> None:
        self.zoo = zoo
        self.tokenizer = tokenizer

    def prompt(self, messages: Messages) -> list[int]:
        """The rendered conversation encoded whole (a first turn's prompt)."""
        return self.encode(self.render(messages))

    def next_prompt(self, messages: Messages, history: list[int]) -> list[int]:
        """A later turn's prompt as the chat builds it: the longest run of the previous
        prompt's and answer's ids that reads as the start of the rendered conversation (an
        answer cut inside a character reads only up to it), then the rest encoded."""
        text = self.render(messages)
        keep = len(history)
        while not text.startswith(self.tokenizer.decode(history[:keep], skip_special_tokens=False)):
            keep -= 1
        assert keep >= len(history) - 4, "the template rewrote the answer: pick another"
        history_text = self.tokenizer.decode(history[:keep], skip_special_tokens=False)
        return history[:keep] + self.encode(text[len(history_text) :])

    def answer(self, prompt_ids: list[int]) -> tuple[list[int], str]:
        ids = self.zoo.hf_greedy("llama", tuple(prompt_ids), MAX_TOKENS)
        # Less a last character the ids leave incomplete: vLLM's detokenizers never emit it.
        return ids, self.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")

    def render(self, messages: Messages) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class CacheModel:
    """The prefix cache as block arithmetic over the token chains computed so far."""

    def __init__(self) -> None:
        self.chains: list[list[int]] = []

    def run(self, prompt: list[int], answer: list[int]) -> tuple[int, int]:
        """(prompt tokens a request hits, blocks held after it): the footer's two figures."""
        most = (len(prompt) - 1) // BLOCK_SIZE
        shared = max((_common_prefix(prompt, chain) for chain in self.chains), default=0)
        hit = min(shared // BLOCK_SIZE, most) * BLOCK_SIZE
        self.chains.append(prompt + answer[:-1])
        return hit, self.num_cached_blocks()

    def num_cached_blocks(self) -> int:
        """Distinct full blocks: a block is its whole prefix, as its chained hash is."""
        return len(
            {
                tuple(chain[: count * BLOCK_SIZE])
                for chain in self.chains
                for count in range(1, len(chain) // BLOCK_SIZE + 1)
            }
        )


@pytest.mark.slow
def test_a_scripted_chat_reuses_each_turns_kv_and_answers_like_transformers(zoo, oracle) -> None:
    user = {"role": "user", "content": "Hello world!"}
    question = {"role": "user", "content": "What is paged attention?"}
    system = {"role": "system", "content": "Be brief."}
    cache = CacheModel()
    p1 = oracle.prompt([user])
    a1, a1_text = oracle.answer(p1)
    p2 = oracle.next_prompt([user, {"role": "assistant", "content": a1_text}, question], p1 + a1)
    a2, a2_text = oracle.answer(p2)
    p_system = oracle.prompt([system, user])
    a_system, a_system_text = oracle.answer(p_system)
    turns = [(p1, a1), (p2, a2), (p1, a1), (p_system, a_system)]  # /reset: p1 again
    expected_footers = [(*cache.run(p, a), len(p), len(a)) for p, a in turns]

    script = "Hello world!\nWhat is paged attention?\n/stats\n/reset\nHello world!\n"
    script += "/system Be brief.\nHello world!\n/system\n/bogus\n\n"
    command = chat_command(zoo.folder("llama"), "--max-tokens", str(MAX_TOKENS), *ENGINE_FLAGS)
    done = subprocess.run(
        command, input=script.encode(), capture_output=True, env=_child_env(), timeout=TIMEOUT_S
    )
    out, err = done.stdout.decode(), done.stderr.decode()

    assert done.returncode == 0, err  # the end of the input ends the chat
    held = expected_footers[1][1]
    hits = expected_footers[0][0] + expected_footers[1][0]
    queried = len(p1) + len(p2)
    stats = [
        f"pool: {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens; 0 in use, {held} cached for reuse, "
        f"{NUM_BLOCKS - held} empty",
        f"prefix cache: {hits} of {queried} prompt tokens served ({hits / queried:.1%}); "
        "0 cached blocks evicted",
        f"tokens: {queried} prompt, {len(a1) + len(a2)} generated since start",
        f"conversation: 2 turns, {len(p2) + len(a2)} tokens of 1024; system message: none",
    ]
    assert out == "\n".join([a1_text, a2_text, *stats, a1_text, a_system_text, ""])
    assert [(hit, blocks, prompt, tokens) for hit, prompt, tokens, blocks, _ in footers(err)] == [
        tuple(str(figure) for figure in expected) for expected in expected_footers
    ]
    # The figures checked are the ones meant: turn 2 reused every full block turn 1 computed;
    # after /reset the prompt is the first message alone again, found in the cache but for
    # its last block; a system message changes the prompt from its first tokens on.
    assert expected_footers[1][0] == (len(p1) + len(a1) - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert expected_footers[2][0] == (len(p1) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected_footers[3][0] == 0
    notes = ("conversation forgotten", "system message set", "system message removed")
    assert all(note in err for note in notes)
    assert "unknown command /bogus: /reset forgets the conversation" in err
    assert "\x1b" not in out + err  # no terminal, no escape codes


def test_a_prompt_keeps_the_previous_ids_as_far_as_the_template_keeps_the_answer(zoo) -> None:
    tokenizer = Tokenizer.from_folder(zoo.folder("llama"))
    user = {"role": "user", "content": "Hello world!"}
    prompt = tokenizer.encode_chat([user])
    # The model spelt its answer a character at a time, where encoding merges characters,
    # and ended it with a space the template trims, then EOS.
    spelt = [token for char in "Paged attention" for token in tokenizer.encode(char, False)]
    history = prompt + spelt + tokenizer.encode(" ", False) + [EOS]
    answer = {"role": "assistant", "content": "Paged attention "}
    messages = [user, answer, {"role": "user", "content": "Why?"}]

    ids = chat.conversation_prompt_ids(tokenizer, messages, history)

    rendered = tokenizer.render_chat(messages)
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered
    assert ids[: len(prompt) + len(spelt)] == prompt + spelt  # up to the trimmed space
    assert ids[len(prompt) + len(spelt)] == EOS  # the template's own end of turn
    assert _common_prefix(ids, tokenizer.encode(rendered, False)) < len(prompt) + len(spelt)


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_the_whole_conversation(
    zoo, oracle
) -> None:
    """Each turn's prompt is cut to the conversation's last N tokens, so the system message
    and the first turn drop out of view while the chat goes on (no PromptTooLong)."""
    keep = 40
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "Hello world!"}
    question = {"role": "user", "content": "What is paged attention?"}
    p1 = oracle.prompt([system, user])
    a1, a1_text = oracle.answer(p1[-keep:])
    p2 = oracle.prompt([system, user, {"role": "assistant", "content": a1_text}, question])
    a2, a2_text = oracle.answer(p2[-keep:])
    assert len(p1) > keep and oracle.answer(p1)[1] != a1_text  # the cut shows

    flags = ["--max-tokens", str(MAX_TOKENS), "--truncate-prompt-tokens", str(keep)]
    command = chat_command(zoo.folder("llama"), *flags, "--system", "Be brief.", *ENGINE_FLAGS)
    script = "Hello world!\nWhat is paged attention?\n"
    done = subprocess.run(
        command, input=script.encode(), capture_output=True, env=_child_env(), timeout=TIMEOUT_S
    )
    out, err = done.stdout.decode(), done.stderr.decode()

    assert done.returncode == 0, err
    assert out == f"{a1_text}\n{a2_text}\n"
    assert [(prompt, tokens) for _, prompt, tokens, _, _ in footers(err)] == [
        (str(keep), str(len(a1))),
        (str(keep), str(len(a2))),
    ]


@pytest.mark.slow
def test_each_footer_gives_its_turns_speculative_figures(zoo, capsys) -> None:
    """With speculation on, a turn's footer ends with what that turn drafted and kept: the
    model drafting for itself keeps every draft, and the turns' counts add up to the engine's."""
    from pagedkv.engine import Engine, EngineArgs

    model = str(zoo.folder("llama"))
    spec = {"model": model, "num_speculative_tokens": 3}
    engine = Engine(EngineArgs(model=model, num_gpu_blocks=NUM_BLOCKS, speculative_config=spec))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    session = chat.Chat(engine, params, system=None)
    figures = re.compile(
        r"; speculative decoding: (\d+) verifications of (\d+) drafted tokens; acceptance rate "
        r"([\d.]+)%, mean accepted length [\d.]+$"
    )
    turns = []
    for text in ("Hello world!", "What is paged attention?"):
        session.turn(text)
        footer = capsys.readouterr().err.strip().splitlines()[-1]
        assert FOOTER.match(footer), footer
        drafts, draft_tokens, rate = figures.search(footer).groups()
        assert rate == "100.0"
        turns.append((int(drafts), int(draft_tokens)))
    total = engine.stats.spec_decoding
    assert turns[1][0] > 0
    assert [sum(counts) for counts in zip(*turns, strict=True)] == [
        total.num_drafts,
        total.num_draft_tokens,
    ]


def test_ctrl_c_stops_an_answer_frees_its_blocks_and_the_chat_goes_on(long_context_model) -> None:
    flags = ["--max-tokens", "16000", "--ignore-eos", "--num-gpu-blocks", "1100"]
    terminal = Terminal(chat_command(long_context_model, *flags, "--swap-space-gb", "0"))
    try:
        terminal.at_prompt()
        first = terminal.interrupt_answer("Hello world!")
        prompt, tokens = int(first[1]), int(first[2])
        assert first[4] == "; stopped" and 0 < tokens < 16000
        # The stopped request's blocks are free; its computed full blocks stay cached.
        computed_blocks = (prompt + tokens - 1) // BLOCK_SIZE
        assert first[3] == str(computed_blocks)
        terminal.send("/stats")
        assert terminal.expect(IN_USE.pattern).groups() == ("0", str(computed_blocks))
        # The stopped answer stays in the conversation, as the user saw it.
        terminal.expect(f"conversation: 1 turn, {prompt + tokens} tokens")
        terminal.at_prompt()

        second = terminal.interrupt_answer("And then?")
        # Its blocks serve the next prompt, up to a half-shown last character.
        assert 0 < int(second[0]) <= computed_blocks * BLOCK_SIZE
        terminal.send("/stats")
        assert terminal.expect(IN_USE.pattern)[1] == "0"
        terminal.at_prompt()
        terminal.write(b"\x03")  # Ctrl-C at the prompt leaves
        assert terminal.wait() == 0
    finally:
        terminal.close()
    assert "Traceback" not in terminal.output
    assert "\x1b[2m" in terminal.output  # the footers are dim on a terminal


@pytest.mark.parametrize("setting", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_a_terminal_that_asks_for_no_colour_gets_none(zoo, setting) -> None:
    flags = ["--max-tokens", "4", *ENGINE_FLAGS]
    terminal = Terminal(chat_command(zoo.folder("llama"), *flags), **setting)
    try:
        terminal.at_prompt()
        terminal.send("Hello world!")
        terminal.expect(FOOTER.pattern)
        terminal.at_prompt()
        terminal.write(b"\x04")  # Ctrl-D at the prompt leaves
        assert terminal.wait() == 0
    finally:
        terminal.close()
    assert "\x1b[2m" not in terminal.output


def test_bad_flags_are_named_and_exit_2(zoo, tmp_path, capsys) -> None:
    model = ["chat", "--model", str(zoo.folder("llama"))]
    assert main([*model, "--top-p", "1.5"]) == 2
    assert "pagedkv chat: error: top_p must be in (0, 1], got 1.5" in capsys.readouterr().err
    for keep, message in (
        ("0", "truncate_prompt_tokens must be an integer >= 1 or -1, got 0"),
        ("2000", "truncate_prompt_tokens is 2000, greater than max_model_len (1024)"),
    ):
        assert main([*model, "--truncate-prompt-tokens", keep, *ENGINE_FLAGS]) == 2
        assert (
            capsys.readouterr().err.splitlines()[-1].startswith(f"pagedkv chat: error: {message}")
        )
    assert main(["chat", "--model", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("pagedkv chat: error: ")
    for flags, message in (
        (["--max-tokens", "0"], "--max-tokens: must be a positive integer, got 0"),
        (["--n", "2"], "pagedkv chat: error: unrecognized arguments: --n 2"),  # chat has no --n
    ):
        with pytest.raises(SystemExit) as exit:
            main([*model, *flags])
        assert exit.value.code == 2
        assert message in capsys.readouterr().err


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(zoo) -> None:
    """A line of bytes that are not UTF-8 gets one line naming the byte; the next line is
    answered."""
    command = chat_command(zoo.folder("llama"), "--max-tokens", "2", *ENGINE_FLAGS)
    done = subprocess.run(
        command, input=b"bad \xff bytes\nHello\n", capture_output=True, env=_child_env(),
        timeout=TIMEOUT_S,
    )  # fmt: skip
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert "pagedkv chat: error: the text is not valid UTF-8: byte 0xff" in err
    assert len(FOOTER.findall(err)) == 1  # the second line was answered


def test_a_model_without_a_chat_template_is_refused(zoo, tmp_path, capsys) -> None:
    folder = tmp_path / "no_template"
    shutil.copytree(zoo.folder("llama"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["chat", "--model", str(folder), *ENGINE_FLAGS]) == 2
    assert "no_template has no chat template" in capsys.readouterr().err


def test_help_lists_the_flags_and_the_chat_commands(capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["chat", "--help"])
    assert exit.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for flag in ("--model", "--system", "--max-tokens", "--temperature", "--num-gpu-blocks"):
        assert flag in help_text
    assert "/reset" in help_text and "/system TEXT" in help_text and "/stats" in help_text


def test_a_chat_is_one_greedy_answer_per_turn_by_default() -> None:
    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    params = sampling_params_from_args(parser.parse_args([]))
    assert params == SamplingParams(n=1, temperature=0.0, max_tokens=512)  # API defaults else


# -- helpers -------------------------------------------------------------------------------


class Terminal:
    """A child process on a pseudo-terminal it controls, so Ctrl-C (0x03) sends it SIGINT."""

    def __init__(self, command: list[str], **env: str) -> None:
        self.master, slave = os.openpty()
        # Wide, so readline never wraps a line of the test.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 250, 0, 0))
        self.process = subprocess.Popen(
            command,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=_child_env(**{"TERM": "xterm", **env}),
            start_new_session=True,
            preexec_fn=_take_controlling_terminal,
        )
        os.close(slave)
        self.output = ""
        self._read_to = 0  # where the next expect starts looking

    def send(self, line: str) -> None:
        self.write(line.encode() + b"\r")

    def write(self, data: bytes) -> None:
        os.write(self.master, data)

    def at_prompt(self) -> None:
        """Wait for the prompt and for line editing to take keys, then a moment more.

        Python notes a SIGINT that arrives while readline handles a key but does not act
        on it until the next key: a person never hits that window, a test would.
        """
        self.expect("> ")
        self.write(b"x\x7f")  # x, then backspace: readline moves back and erases it
        self.expect(r"x\x08(\x1b\[K| \x08)")
        time.sleep(0.2)

    def interrupt_answer(self, line: str) -> tuple[str, ...]:
        """Ask, press Ctrl-C once the answer streams, return the footer's groups."""
        self.send(line)
        self.expect(re.escape(line) + r"\r\n[^\r\n]{8}")  # the echo, then the answer
        self.write(b"\x03")
        groups = self.expect(FOOTER.pattern).groups()
        self.at_prompt()
        return groups

    def expect(self, pattern: str) -> re.Match[str]:
        """Read until `pattern` matches the output after the last match; return that match."""
        regex = re.compile(pattern, flags=re.MULTILINE)
        deadline = time.monotonic() + TIMEOUT_S
        while (match := regex.search(self.output, self._read_to)) is None:
            if time.monotonic() > deadline or not self._read(deadline):
                raise AssertionError(f"no {pattern!r} in the output:\n{self.output}")
        self._read_to = match.end()
        return match

    def wait(self) -> int:
        """Read until the child closes the terminal; its exit status."""
        deadline = time.monotonic() + TIMEOUT_S
        while self._read(deadline):
            if time.monotonic() > deadline:
                raise AssertionError(f"the chat did not exit:\n{self.output}")
        return self.process.wait(timeout=TIMEOUT_S)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.close(self.master)

    def _read(self, deadline: float) -> bool:
        """Read what the child wrote; False once it has closed the terminal."""
        ready, _, _ = select.select([self.master], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every process holding the terminal has exited
            return False
        self.output += data.decode(errors="replace")
        return bool(data)


def _take_controlling_terminal() -> None:
    """In the child, after setsid: make its stdin, the pty, its controlling terminal, and let
    SIGINT act as it does for a chat started from a terminal.

    A shell without job control starts a background job (`pytest ... &` in a script) with
    SIGINT ignored; an ignored signal stays ignored across exec, and Python then installs no
    KeyboardInterrupt handler, so Ctrl-C would do nothing in the child."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def chat_command(model: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "pagedkv.cli", "chat", "--model", str(model), *flags]


def footers(text: str) -> list[tuple[str, ...]]:
    """(cached, prompt, tokens, held, ending) of every footer, in order."""
    return [match.groups() for match in FOOTER.finditer(text)]


def _child_env(**changes: str) -> dict[str, str]:
    """This environment with the pagedkv under test first on the path, colour allowed."""
    source = str(Path(pagedkv.__file__).parents[1])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    env = {key: value for key, value in os.environ.items() if key != "NO_COLOR"}
    return {**env, "PYTHONPATH": path, **changes}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
