"""`pagedkv chat`: a conversation with a model in the terminal, answers streamed as they come.

Every line read is a user message, except the commands `/reset` (forget the conversation),
`/system TEXT` (set the system message and start over; `/system` alone removes it) and
`/stats` (the KV pool and the prefix cache now). The whole conversation is sent every turn,
rendered with the model's chat template, as a new engine request; the turns before it are
not computed again because the engine's prefix cache still holds their KV blocks.

Each turn's prompt begins with the previous turn's prompt and answer ids, exactly as the
engine saw and generated them, as far as they read as the start of the rendered
conversation, followed by the rest of it encoded (`conversation_prompt_ids`). Encoding the
whole rendered text anew instead can split the previous answer into other tokens than the
model produced, and a prefix-cache hit ends at the first differing token. The model sees the
same text either way; only the split of the answer into tokens is the model's own.

Ctrl-C during an answer stops it (the request is aborted, its blocks freed) and the chat goes
on; the partial answer stays in the conversation, as the user saw it: it is what the model
said, and the next question may well be about it (vLLM's and OpenAI's semantics for a
stopped stream). Ctrl-C or Ctrl-D at the prompt, or the end of the input, leaves with status
0: leaving is the normal end of a chat, not a failure.

Output is kept predictable for scripts (`printf 'hi\\n/stats\\n' | pagedkv chat`): stdout holds
only the answers (each ending with a newline) and what `/stats` prints, since those were
asked for; the footer after each answer, notices and errors go to stderr, like the engine's
start-up lines. The `> ` prompt and the greeting appear only when stdin and stdout are both a
terminal. Footers and notices are dim only when stdout and stderr are both terminals, NO_COLOR
is empty or unset (no-color.org) and TERM is not "dumb", so no escape code reaches a file or
a pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.engine import Engine, RequestOutput, SamplingParams
    from pagedkv.engine.spec.metrics import SpecDecodingStats
    from pagedkv.tokenizer import Tokenizer

Message = dict[str, str]
COMMANDS_HELP = (
    "/reset forgets the conversation, /system TEXT sets the system message (and resets), "
    "/stats shows the KV pool and the prefix cache"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--system, sampling flags (one answer per turn: no --n) and engine flags."""
    from pagedkv.commands.sampling_args import add_sampling_args
    from pagedkv.engine.args import EngineArgs

    parser.epilog = (
        f"In the chat: {COMMANDS_HELP}. Ctrl-C stops an answer; Ctrl-D or Ctrl-C at the "
        "prompt leaves. Answers go to stdout, the footer after each to stderr."
    )
    parser.add_argument("--system", default=None, help="system message to start with")
    add_sampling_args(parser, max_tokens=512, samples=False)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    """Load the model, then answer each line read until the input ends."""
    from pagedkv.commands.sampling_args import sampling_params_from_args
    from pagedkv.engine import Engine, EngineArgs
    from pagedkv.engine.admission import check_truncation
    from pagedkv.engine.args import flag_error
    from pagedkv.engine.errors import STARTUP_ERRORS

    try:
        sampling_params_from_args(args)  # a bad flag is named before the model loads
        engine = Engine(EngineArgs.from_cli_args(args))
        params = sampling_params_from_args(args, engine.sampling_defaults)
        # A --truncate-prompt-tokens past the context would refuse every turn: refuse it now.
        check_truncation(params, engine.max_model_len)
    except STARTUP_ERRORS as error:
        print(f"pagedkv chat: error: {flag_error(error)}", file=sys.stderr)
        return 2
    if engine.tokenizer.chat_template is None:
        print(f"pagedkv chat: error: {engine.model_name} has no chat template", file=sys.stderr)
        return 2
    return Chat(engine, params, args.system).run()


@dataclass
class Answer:
    """One turn's answer as the engine reported it, gathered from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    finish_reason: str | None = None
    seconds: float = 0.0  # from the request's arrival to its end, prompt included
    spec: SpecDecodingStats | None = None  # what speculative decoding kept this turn (None: off)

    def take(self, delta: RequestOutput) -> str:
        """Add one delta of the request; return its new text."""
        self.prompt_token_ids = delta.prompt_token_ids
        self.num_cached_tokens = delta.num_cached_tokens
        text = ""
        for output in delta.outputs:
            self.token_ids += output.token_ids
            self.finish_reason = output.finish_reason or self.finish_reason
            text += output.text
        self.text += text
        return text


@dataclass(frozen=True)
class PoolCounts:
    """The GPU block pool at one moment: every block is in one of three states."""

    in_use: int  # in a running request's block table
    cached: int  # free, but holding a full block of KV a later prompt can reuse
    empty: int  # free, holding nothing reusable

    @property
    def held(self) -> int:
        """Blocks holding KV now: in use plus cached for reuse."""
        return self.in_use + self.cached


class Chat:
    """One engine, the conversation so far, and the terminal it talks to."""

    def __init__(self, engine: Engine, params: SamplingParams, system: str | None) -> None:
        self.engine = engine
        self.params = params
        self.system = system
        self.messages: list[Message] = []  # user and assistant turns, system excluded
        # The last turn's prompt + answer ids: the KV the prefix cache holds for the next.
        self.history_ids: list[int] = []
        self.num_requests = 0
        self.interactive = sys.stdin.isatty() and sys.stdout.isatty()

    def run(self) -> int:
        """Read lines until the input ends or Ctrl-C at the prompt; 0 either way."""
        if self.interactive:
            _enable_line_editing()
            self.note(f"chatting with {self.engine.model_name}; {COMMANDS_HELP}; Ctrl-D leaves")
        while True:
            try:
                line = input("> " if self.interactive else "").strip()
            except (EOFError, KeyboardInterrupt):
                if self.interactive:
                    print()
                return 0
            try:
                self.handle(line)
            except KeyboardInterrupt:
                # Ctrl-C just as an answer ended, or during a command: back to the prompt.
                print(flush=True)

    def handle(self, line: str) -> None:
        """A slash command, or a user message to answer; an empty line does nothing."""
        if line.startswith("/"):
            self.command(line)
        elif line:
            self.turn(line)

    def command(self, line: str) -> None:
        """Run one slash command; an unknown one is named, with the list."""
        name, _, rest = line.partition(" ")
        if name == "/reset":
            self.reset()
            self.note("conversation forgotten")
        elif name == "/system":
            self.system = rest.strip() or None
            self.reset()
            self.note("system message set" if self.system else "system message removed")
        elif name == "/stats":
            print("\n".join(self.stats_lines()), flush=True)
        else:
            self.note(f"unknown command {name}: {COMMANDS_HELP}")

    def reset(self) -> None:
        """Forget the conversation (its KV stays in the prefix cache until evicted)."""
        self.messages = []
        self.history_ids = []

    def turn(self, text: str) -> None:
        """Send the conversation with `text` added; stream the answer and keep both."""
        from pagedkv.engine import RequestRejected
        from pagedkv.model.errors import ChatTemplateError
        from pagedkv.tokenizer import InvalidText

        user = {"role": "user", "content": text}
        messages = [*self.system_messages(), *self.messages, user]
        try:
            prompt_ids = conversation_prompt_ids(self.engine.tokenizer, messages, self.history_ids)
            answer = self.stream(prompt_ids)
        except (RequestRejected, ChatTemplateError, InvalidText) as error:
            self.note(f"pagedkv chat: error: {error}; /reset starts a new conversation")
            return
        self.messages += [user, {"role": "assistant", "content": answer.text}]
        self.history_ids = answer.prompt_token_ids + answer.token_ids
        self.note(self.footer(answer))

    def stream(self, prompt_ids: list[int]) -> Answer:
        """Ask the engine, printing the answer as it comes; Ctrl-C stops it and frees it."""
        request_id = f"turn-{self.num_requests}"
        self.num_requests += 1
        answer = Answer()
        started = time.perf_counter()
        spec_before = self.engine.stats.spec_decoding
        try:
            self.engine.add_request(request_id, prompt_ids, self.params)
            self.step_until_done(request_id, answer)
        except KeyboardInterrupt:
            self.engine.abort(request_id)  # frees its blocks; the next step reports it
            self.step_until_done(request_id, answer)
        answer.seconds = time.perf_counter() - started
        if spec_before.enabled:
            answer.spec = self.engine.stats.spec_decoding.since(spec_before)
        print(flush=True)
        return answer

    def step_until_done(self, request_id: str, answer: Answer) -> None:
        """Step until the engine has no unfinished work, printing this request's text.

        Another request's delta (an abort that a second Ctrl-C left unreported) is skipped.
        """
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                if delta.request_id == request_id:
                    sys.stdout.write(answer.take(delta))
                    sys.stdout.flush()

    def system_messages(self) -> list[Message]:
        """The system message as the conversation's first message, if one is set."""
        return [] if self.system is None else [{"role": "system", "content": self.system}]

    def footer(self, answer: Answer) -> str:
        """Where the answer's prompt came from, how fast it came, and what the pool holds."""
        num_tokens = len(answer.token_ids)
        rate = num_tokens / answer.seconds if answer.seconds > 0 else 0.0
        ending = {"abort": "; stopped", "length": "; cut at the length limit"}
        return (
            f"{answer.num_cached_tokens} of {len(answer.prompt_token_ids)} prompt tokens "
            f"from the prefix cache, {num_tokens} tokens, {rate:.1f} tok/s, "
            f"{pool_counts(self.engine).held} blocks held"
            + ending.get(answer.finish_reason or "", "")
            + ("" if answer.spec is None else f"; {answer.spec.describe()}")
        )

    def stats_lines(self) -> list[str]:
        """The pool block by block state, the prefix cache, token totals, the conversation."""
        stats = self.engine.stats
        pool = pool_counts(self.engine)
        num_turns = sum(1 for message in self.messages if message["role"] == "user")
        turns = f"{num_turns} turn" + ("" if num_turns == 1 else "s")
        return [
            f"pool: {stats.num_gpu_blocks} blocks of {stats.block_size} tokens; "
            f"{pool.in_use} in use, {pool.cached} cached for reuse, {pool.empty} empty",
            f"prefix cache: {stats.prefix_hit_tokens} of {stats.prefix_queried_tokens} prompt "
            f"tokens served ({stats.prefix_hit_rate:.1%}); "
            f"{self.engine.manager.stats.evictions} cached blocks evicted",
            f"tokens: {stats.prompt_tokens_total} prompt, "
            f"{stats.generation_tokens_total} generated since start",
            f"conversation: {turns}, {len(self.history_ids)} tokens "
            f"of {self.engine.max_model_len}; system message: "
            + ("none" if self.system is None else repr(self.system)),
        ]

    def note(self, text: str) -> None:
        """A line for the person at the terminal, not part of the answers: stderr, dim."""
        sys.stdout.flush()
        print(_dim(text) if _styled() else text, file=sys.stderr, flush=True)


def conversation_prompt_ids(
    tokenizer: Tokenizer, messages: Sequence[Message], history_ids: Sequence[int]
) -> list[int]:
    """The prompt ids of `messages` rendered for a reply: the longest run of `history_ids`
    that reads as the start of the rendered text, then the rest of the text encoded.

    The run stops short of the whole history where the text does not follow it: a stop token
    the template writes differently, a character an interrupted answer left half-generated,
    whitespace the template trims. With no such run the text is encoded whole.
    """
    text = tokenizer.render_chat(messages)
    kept = _longest_prefix_reading_as(tokenizer, history_ids, text)
    rest = text[len(tokenizer.decode(kept, skip_special_tokens=False)) :]
    spliced = kept + tokenizer.encode(rest, add_special_tokens=False)
    # A decoder that adds or drops a space at the seam would change the text: encode it whole.
    if tokenizer.decode(spliced, skip_special_tokens=False) != text:
        return tokenizer.encode(text, add_special_tokens=False)
    return spliced


def _longest_prefix_reading_as(
    tokenizer: Tokenizer, token_ids: Sequence[int], text: str
) -> list[int]:
    """The longest leading ids whose decoded text begins `text`, found by bisection.

    Where a run ends on half a character it decodes to U+FFFD and fails while a longer one
    may pass, so bisection can settle below the longest; the result still reads as a prefix.
    """
    low, high = 0, len(token_ids)  # the first `low` ids read as a prefix
    while low < high:
        middle = (low + high + 1) // 2
        if text.startswith(tokenizer.decode(token_ids[:middle], skip_special_tokens=False)):
            low = middle
        else:
            high = middle - 1
    return list(token_ids[:low])


def pool_counts(engine: Engine) -> PoolCounts:
    """Count the GPU blocks in use, cached for reuse and empty, from the memory manager's
    counters (no pool map: that would walk every block of a large pool each turn)."""
    manager = engine.manager
    cached = manager.num_free_cached_blocks
    return PoolCounts(
        in_use=manager.num_gpu_blocks - manager.num_free_blocks,
        cached=cached,
        empty=manager.num_free_blocks - cached,
    )


def _enable_line_editing() -> None:
    """Arrow keys and history for `input()` where the readline module exists."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - importing it is what hooks it into input()


def _styled() -> bool:
    """Whether escape codes may be written: to terminals only, and ones that want them."""
    terminals = sys.stdout.isatty() and sys.stderr.isatty()
    return terminals and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def _dim(text: str) -> str:
    return f"\x1b[2m{text}\x1b[0m"
