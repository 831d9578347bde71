"""Reasoning outputs (vLLM's `--reasoning-parser`): a thinking model's `<think>...</think>`
block returned apart from its answer, as the message's `reasoning` (and vLLM's older name,
`reasoning_content`), the answer alone as its `content`.

One rule for both names vLLM gives it (`deepseek_r1`, `qwen3`), the same for a whole output
and for one streamed a piece at a time (`ReasoningSplitter`):
- The model thinks if the generation prompt left a think block open (its last think tag is
  `<think>`, as DeepSeek-R1's template and Qwen's thinking-only ones end it; the conversation
  before it never counts: `chat.opens_think_block`), or the output starts with `<think>`
  (after any whitespace; the tag itself is dropped, also after a prompt that opened one).
  Otherwise the whole output is content: Qwen3 with `enable_thinking: false`, whose template
  closes an empty block in the generation prompt, or a model that does not think.
- While it thinks, the text up to the first `</think>` is reasoning and the rest content
  (None when there is none). An output cut off before `</think>` is all reasoning, as vLLM's
  `deepseek_r1` (and `qwen3` since 0.17) return it.
vLLM's `deepseek_r1` calls an output with no think tag anywhere reasoning too; here it is
content, the answer of a model that did not think. Nothing is stripped: Qwen's content starts
with the blank line after `</think>`, as vLLM returns it.

Tool calls are read from the content only, and only the completions of chat are split (the
completions endpoint returns the text as it is), as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def thinking_prompt(prompt_text: str) -> bool:
    """Whether text leaves a think block open: its last think tag is `<think>`."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


@dataclass
class ReasoningSplitter:
    """Splits one choice's output into reasoning and content as it arrives (`feed`); the
    pieces of every feed add up to the split of the whole output."""

    thinking: bool  # in a think block now: at first, whether the prompt left one open
    decided: bool = field(default=False, init=False)  # the output's start was read for a tag
    thought: bool = field(init=False)  # whether any of the output was inside a think block
    _held: str = field(default="", init=False)  # not yet known: reasoning, content or a tag

    def __post_init__(self) -> None:
        self.thought = self.thinking

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """This piece's (reasoning, content); `final` with the output's last piece. Text that
        may be the start of a tag is held back until a later piece tells."""
        text, self._held = self._held + text, ""
        if not self.decided:
            opening = text.lstrip()
            if opening.startswith(THINK_START):
                self.thinking = self.thought = True
                text = opening[len(THINK_START) :]
            elif THINK_START.startswith(opening) and not final:
                self._held = text  # whitespace, or "<thi": the tag may be coming
                return "", ""
            self.decided = True
        if not self.thinking:
            return "", text
        reasoning, end, content = text.partition(THINK_END)
        if end:
            self.thinking = False
            return reasoning, content
        if not final:
            keep = _tag_prefix_at_end(reasoning, THINK_END)
            self._held = reasoning[len(reasoning) - keep :]
            reasoning = reasoning[: len(reasoning) - keep]
        return reasoning, ""


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content): reasoning None where the model did not think,
    content None where nothing follows the reasoning."""
    splitter = ReasoningSplitter(thinking)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if splitter.thought else None), (content or None)


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
