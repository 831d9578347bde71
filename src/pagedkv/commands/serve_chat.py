"""`pagedkv serve`'s chat rendering options: the template, how messages reach it, the reply's
role, the reasoning parser, and whether a request may bring its own template.

A request's own `chat_template` is refused unless the server is started with
`--trust-request-chat-template`, as vLLM's: a jinja template is a program, and the sandbox
bounds what it may touch, not how long it runs or how much it builds (a 31-byte template
rendering `'ab ' * 4000000` took 14 s and 1.7 GB of the server's memory).
"""

from __future__ import annotations

import argparse
import codecs
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.server import ServerConfig


def add_chat_arguments(group: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """The chat rendering flags, into the server's argument group."""
    from pagedkv.server.reasoning import REASONING_PARSERS
    from pagedkv.tokenizer.chat_template import CONTENT_FORMATS

    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the chat template of chat completions instead of the model's: a jinja file, or "
        "the template itself (text with {, } or a new line; \\n and other escapes are read, "
        "as vLLM reads them); a request's own chat_template wins where "
        "--trust-request-chat-template allows one",
    )
    group.add_argument(
        "--response-role",
        default=defaults.response_role,
        help="the role of a chat reply that starts a new turn (add_generation_prompt), as "
        "vLLM's; a reply that continues the last message takes its role (default: "
        "%(default)s)",
    )
    group.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default=defaults.chat_template_content_format,
        help="how a message's content reaches the template: 'string' (one string, text parts "
        "joined by new lines), 'openai' (a list of {type, text} parts) or 'auto' (openai for "
        "a template that loops over a message's content, as vLLM detects it; default: "
        "%(default)s)",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="return a thinking model's <think>...</think> block apart from its answer, as "
        "each chat reply's `reasoning` (and vLLM's older `reasoning_content`), as vLLM's "
        "(both names read think tags alike; see docs/serving.md)",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat template a request brings (chat_template, or chat_template_kwargs' "
        "chat_template) instead of refusing it with a 400, as vLLM's flag: a template is a "
        "program the server runs, so allow it only for clients you trust",
    )


def chat_template_text(given: str) -> str:
    """`--chat-template`'s jinja: the file it names, or, where it is no file and reads as
    jinja (it has `{`, `}` or a new line, as vLLM tells them apart), the text itself with its
    backslash escapes read. Bad jinja is a `ChatTemplateError` here, before the model loads."""
    from pagedkv.tokenizer.chat_template import compile_template

    try:
        named_file = Path(given).is_file()
    except OSError:  # a long inline template is no file name (ENAMETOOLONG), as vLLM takes it
        named_file = False
    if named_file:
        text = Path(given).read_text(encoding="utf-8")
    elif any(mark in given for mark in "{}\n"):
        text = codecs.decode(given.encode("latin-1", "backslashreplace"), "unicode_escape")
    else:
        raise ValueError(f"{given!r} is no file, and no jinja template")
    compile_template(text)
    return text
