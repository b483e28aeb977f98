"""Chat templates: the built-in format, Jinja templates as transformers renders them.

``tokenize_chat`` takes three kinds of template (see
:class:`~zephon_torch.ops.tokenize_chat.TokenizeChat`); this module holds what
is about templates themselves, apart from tokenizing:

- :data:`DEFAULT_CHAT_TEMPLATE`, the built-in per-message format string, and
  :func:`is_jinja_template`, which tells a Jinja string from a format string;
- :func:`default_template_of`, the default template of what a tokenizer
  stores (one string, or transformers' set of named templates);
- :func:`compile_jinja`, a Jinja template compiled as transformers compiles
  one, with the ``{% generation %}`` tag marking what the assistant writes,
  and :func:`split_generation_marks`, which takes those marks out again and
  says where they were::

      rendered  "<|user|>Hi<|assistant|>" OPEN "Hello" CLOSE "<|end|>"
      split  -> "<|user|>Hi<|assistant|>Hello<|end|>",  spans [(23, 28)]
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "GENERATION_MARK",
    "GENERATION_TAG",
    "RESERVED_TEMPLATE_VARIABLES",
    "ChatTemplate",
    "compile_jinja",
    "default_template_of",
    "is_jinja_template",
    "split_generation_marks",
    "template_failure",
]

#: The built-in per-turn chat format (``{role}`` and ``{content}`` placeholders).
DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"

#: A chat template callable: ``messages -> [(text, is_assistant), ...]``.
ChatTemplate = Callable[[Sequence[Mapping[str, Any]]], Sequence[tuple[str, bool]]]


#: Wrapped around what a ``{% generation %}`` block renders, then removed again: the
#: characters between them are the assistant's (NUL bytes, so no real text holds them).
_GENERATION_OPEN = "\x00zephon-generation-open\x00"
_GENERATION_CLOSE = "\x00zephon-generation-close\x00"
GENERATION_MARK = "\x00zephon-generation-"
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
#: Template variables the operator sets itself (chat_template_kwargs cannot).
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt")


def is_jinja_template(template: str) -> bool:
    """Whether a ``chat_template`` string is Jinja (``{% ... %}`` or ``{{ ... }}``) rather
    than the per-message format string of :data:`DEFAULT_CHAT_TEMPLATE`."""
    return "{%" in template or "{{" in template


def compile_jinja(source: str, where: str) -> Any:
    """A chat template compiled the way transformers compiles one.

    A sandboxed, immutable Jinja environment with ``trim_blocks`` and
    ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
    that keeps non-ASCII text, ``raise_exception``, and the ``{% generation
    %}`` tag. ``strftime_now`` is left out on purpose: a template that reads
    the clock would give a different output every day (templates that test
    ``strftime_now is defined`` fall back to their fixed date).
    """
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ImportError(
            f"the chat template ({where}) is a Jinja template, which needs jinja2: pip "
            "install jinja2 (or pip install 'zephon-torch[hf]'); or pass "
            "chat_template=DEFAULT_CHAT_TEMPLATE for the built-in format"
        ) from exc

    class GenerationMarks(Extension):
        """``{% generation %}...{% endgeneration %}``: marks what the block renders."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Callable[[], str]) -> str:
            return f"{_GENERATION_OPEN}{caller()}{_GENERATION_CLOSE}"

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which a prompt must not see.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationMarks, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template ({where}) is not valid Jinja (line {exc.lineno}: "
                         f"{exc.message}); fix it, or pass chat_template=... yourself") from exc


def split_generation_marks(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without the generation marks, and the ``[start, end)`` character span
    of each outermost generation block in it."""
    text: list[str] = []
    spans: list[tuple[int, int]] = []
    at = depth = 0
    start = 0
    for part in re.split(f"({re.escape(_GENERATION_OPEN)}|{re.escape(_GENERATION_CLOSE)})",
                         marked):
        if part == _GENERATION_OPEN:
            if depth == 0:
                start = at
            depth += 1
        elif part == _GENERATION_CLOSE:
            depth -= 1
            if depth == 0:
                spans.append((start, at))
        else:
            text.append(part)
            at += len(part)
    return "".join(text), spans


def default_template_of(value: Any, where: str) -> str | None:
    """The default template of a ``chat_template`` entry: a string, or a list/dict of
    named templates (transformers' format for several)."""
    if value is None or isinstance(value, str):
        return value or None
    named: dict[str, Any] = {}
    if isinstance(value, Mapping):
        named = dict(value)
    elif isinstance(value, list) and all(isinstance(t, Mapping) for t in value):
        named = {t.get("name"): t.get("template") for t in value}
    if "default" in named and isinstance(named["default"], str):
        return named["default"]
    raise ValueError(
        f"the chat_template in {where} is a set of named templates {sorted(map(str, named))} "
        "without a 'default' one; pass the one you want as chat_template=<template text>"
    )



def template_failure(exc: Exception) -> str:
    """What to say when a Jinja template raises on a conversation."""
    text = f"the chat template failed on it ({type(exc).__name__}: {exc})"
    if "strftime_now" in str(exc):
        text += ("; strftime_now (the current date) is left out so that the output does not "
                 "change from day to day: pass the date the template wants through "
                 "chat_template_kwargs (e.g. {'date_string': '26 Jul 2024'})")
    return text
