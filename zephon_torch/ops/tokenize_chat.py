"""The ``tokenize_chat`` operator: conversations to ``input_ids`` and a ``loss_mask``.

Like ``tokenize`` it is stateless, encodes one micro-batch with one batched
call, and keeps each record's meta; the tokenizer, its special ids and the
handling of a bad sample come from
:class:`~zephon_torch.ops.tokenizer_base.TokenizerOperator`.

Chat samples with the built-in template or a callable are rendered into
segments, each tokenized on its own so the ``loss_mask`` lines up exactly with
the tokens: 1 on assistant content and the EOS that ends each assistant turn,
0 elsewhere. With the default template ``"<|{role}|>\\n{content}\\n"``::

    segment            "<|user|>\\n"  "Hi"  "\\n"  "<|assistant|>\\n"  "Hello"  EOS  "\\n"
    loss_mask               0          0     0          0              1      1    0

With the model's own Jinja template (from the tokenizer directory or the
transformers tokenizer), the conversation is rendered as transformers renders
it (:mod:`zephon_torch.ops.chat_templates`) and tokenized as one text; the
mask is 1 on the tokens that start inside an assistant span (a ``{%
generation %}`` block, or what the assistant message adds after the
generation prompt when the conversation is rendered prefix by prefix).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.block import Block
from zephon_torch.ops.base import Element, live_records
from zephon_torch.ops.chat_templates import (
    DEFAULT_CHAT_TEMPLATE,
    GENERATION_MARK,
    GENERATION_TAG,
    RESERVED_TEMPLATE_VARIABLES,
    ChatTemplate,
    compile_jinja,
    default_template_of,
    is_jinja_template,
    split_generation_marks,
    template_failure,
)
from zephon_torch.ops.io import _lone_surrogate
from zephon_torch.ops.placement import set_placement
from zephon_torch.ops.tokenizer_base import TokenizerOperator, check_field_name, unencodable
from zephon_torch.ops.tokenizer_loading import (
    BOS_TOKEN_CANDIDATES,
    EOS_TOKEN_CANDIDATES,
    TokenizerSource,
    load_tokenizer,
)
from zephon_torch.ops.transform import callable_config
from zephon_torch.types import SampleRecord

__all__ = ["CHAT_ROLES", "TokenizeChat"]

#: Roles ``tokenize_chat`` accepts by default.
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


class _Unlocatable(Exception):
    """The template does not render a conversation prefix by prefix."""


class TokenizeChat(TokenizerOperator):
    """Tokenize chat conversations into ``input_ids`` and an aligned ``loss_mask``.

    Each sample's ``field`` is a list of ``{"role": str, "content": str}``
    messages (other keys are passed to a Jinja template as they are).
    ``loss_mask`` is 1 on the tokens the model should learn to write (each
    assistant reply and its end of turn) and 0 elsewhere (BOS, role headers,
    system/user/tool content). Three kinds of template:

    - **The model's own Jinja template** (``chat_template=None`` and the
      tokenizer directory or transformers tokenizer has one, or a Jinja
      string). It is rendered as transformers' ``apply_chat_template`` does,
      and the whole text is tokenized in one piece, so ``input_ids`` are what
      the model sees at inference. The template writes the special tokens
      (BOS, end of turn); the operator adds none. Assistant tokens are
      those covering any character of an assistant span: the text of a
      ``{% generation %}`` block when the template has them, otherwise what
      each assistant message adds after the generation prompt (found by
      rendering the conversation prefix by prefix; a template that does not
      extend its earlier output that way is an error for that sample, never
      a wrong mask).
    - **A format string** (:data:`DEFAULT_CHAT_TEMPLATE`, used when the
      tokenizer has no template of its own): one ``{content}`` and any
      number of ``{role}`` placeholders, rendered per message.
    - **A callable** ``messages -> [(text, is_assistant), ...]``.

    With the last two, every segment is tokenized on its own, so the mask is
    exact by construction, and BOS/EOS are added per ``special_tokens`` (EOS
    after each assistant turn, supervised).

    Args:
        tokenizer: As for :class:`Tokenize`.
        field: Payload key holding the messages.
        out_field: Payload key receiving the ``int32`` ids.
        mask_field: Payload key receiving the ``uint8`` mask.
        chat_template: ``None``: the tokenizer's own Jinja template
            (``chat_template.jinja`` or ``tokenizer_config.json`` of a
            directory, a transformers tokenizer's ``chat_template``), else
            :data:`DEFAULT_CHAT_TEMPLATE`. A string: Jinja when it holds
            ``{%`` or ``{{`` (:func:`is_jinja_template`), else a format string.
            Or a callable; each maximal run of its assistant segments is one
            assistant turn.
        loss_on_last_turn_only: Supervise only the last assistant turn.
        roles: Accepted message roles (must include ``"assistant"``).
        special_tokens: ``None`` (default): ``"none"`` with a Jinja template
            (the only mode it takes), ``"bos_eos"`` otherwise (BOS first, EOS
            after each assistant turn). Or ``"eos"``, ``"bos"``, ``"none"``;
            use ``"bos"`` or ``"none"`` when a callable template writes its own
            end-of-turn text.
        bos_token_id: As for :class:`Tokenize`.
        eos_token_id: As for :class:`Tokenize`.
        max_length: Cut ids and mask to this many tokens (no special-token
            repair: a cut turn simply loses its end).
        chat_template_kwargs: Extra variables for a Jinja template (JSON
            values), e.g. ``{"date_string": "26 Jul 2024"}`` or
            ``{"enable_thinking": False}``; like the keyword arguments of
            ``apply_chat_template``. The special tokens of the tokenizer's
            configuration (``bos_token``, ``eos_token``, ...) are set already.
        on_error: Malformed messages, messages the tokenizer cannot encode, or
            a conversation the Jinja template fails on: ``"raise"`` a
            ``ValueError`` or ``"skip"`` (tombstone with reason
            ``"tokenize_chat_error"``). The source's ``on_error`` does not
            reach this operator.
        placement: As for :class:`Tokenize`.

    Raises:
        ValueError: A bad template, mode, role list, ``max_length``,
            ``chat_template_kwargs``, or a missing special token.
        TypeError: ``tokenizer`` or ``chat_template`` of the wrong kind.
        ImportError: A Jinja template without jinja2 installed.
    """

    name = "tokenize_chat"
    default_microbatch_size = 512
    _separator = ": "  # "tokenize_chat: sample (0, 0, 1): message 2 has role 'bot'"
    # It lived in ops/tokenize.py, the name the fingerprints of saved states hold.
    _config_name = "zephon_torch.ops.tokenize.TokenizeChat"

    def __init__(self, tokenizer: Any, *, field: str = "messages", out_field: str = "input_ids",
                 mask_field: str = "loss_mask", chat_template: str | ChatTemplate | None = None,
                 loss_on_last_turn_only: bool = False, roles: Sequence[str] = CHAT_ROLES,
                 special_tokens: str | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, max_length: int | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 on_error: str = "raise", placement: Any = "local") -> None:
        for name, value in (("field", field), ("out_field", out_field),
                            ("mask_field", mask_field)):
            check_field_name(name, value)
        set_placement(self, placement)
        if out_field == mask_field:
            raise ValueError(f"out_field and mask_field must differ, both are {out_field!r}")
        source = load_tokenizer(tokenizer)
        jinja: str | None = None
        template_from: str | None = None
        if chat_template is None:
            template: Any = DEFAULT_CHAT_TEMPLATE
            own = default_template_of(source.chat_template, str(source.chat_template_from))
            if own is not None:
                jinja, template_from = own, source.chat_template_from
        else:
            template = chat_template
            template_from = "the chat_template argument"
            if isinstance(template, str) and is_jinja_template(template):
                jinja = template
        if jinja is not None:
            template = jinja
        elif isinstance(template, str):
            if template.count("{content}") != 1:
                raise ValueError(
                    "a string chat_template needs exactly one '{content}' placeholder (and "
                    f"optionally '{{role}}'), or Jinja syntax ('{{%', '{{{{'), got {template!r}"
                )
            prefix, suffix = template.split("{content}")
            self._prefix, self._suffix = prefix, suffix
        elif not callable(template):
            raise TypeError(
                "chat_template must be None, a Jinja or format string, or a callable "
                f"messages -> [(text, is_assistant), ...], got {type(template).__name__}"
            )
        if special_tokens is None:
            special_tokens = "none" if jinja is not None else "bos_eos"
        elif jinja is not None and special_tokens != "none":
            raise ValueError(
                f"special_tokens={special_tokens!r} cannot be used with the Jinja chat template "
                f"({template_from}): the template writes the model's own special tokens (BOS, "
                "end of turn) and the operator adds none; leave special_tokens unset (or "
                "'none'), or pass chat_template=DEFAULT_CHAT_TEMPLATE for the built-in format"
            )
        given = [f"{name}={value!r}" for name, value in (("bos_token_id", bos_token_id),
                                                          ("eos_token_id", eos_token_id))
                 if value is not None]
        if jinja is not None and given:
            raise ValueError(
                f"{', '.join(given)} cannot be used with the Jinja chat template "
                f"({template_from}): the template writes the model's own special tokens and "
                "the operator adds none; leave them out"
            )
        roles = tuple(roles)
        if "assistant" not in roles or not all(isinstance(r, str) for r in roles):
            raise ValueError(f"roles must be strings and include 'assistant', got {roles!r}")
        if max_length is not None and (not isinstance(max_length, int)
                                       or isinstance(max_length, bool) or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        self._init_tokenizer(source, special_tokens=special_tokens,
                             bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                             on_error=on_error)
        self.field = field
        self.out_field = out_field
        self.mask_field = mask_field
        self.chat_template = template
        #: ``"jinja"``, ``"format"`` or ``"callable"``.
        self.template_kind = ("jinja" if jinja is not None
                              else "format" if isinstance(template, str) else "callable")
        #: Where a Jinja template came from (None for the other kinds).
        self.chat_template_source = template_from if jinja is not None else None
        self.loss_on_last_turn_only = bool(loss_on_last_turn_only)
        self.roles = roles
        self.max_length = max_length
        self._jinja: Any = None
        self._template_variables: dict[str, Any] = {}
        if jinja is not None:
            self._template_variables = self._jinja_variables(source, chat_template_kwargs)
            self._generation_blocks = bool(GENERATION_TAG.search(jinja))
            _ = self._compiled  # a syntax error is reported now, not on the first sample
        elif chat_template_kwargs is not None:
            raise ValueError(
                "chat_template_kwargs are variables of a Jinja chat template, but the chat "
                f"template here is a {self.template_kind} one; leave them out"
            )

    def _jinja_variables(self, source: TokenizerSource,
                         extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """The variables a Jinja template sees besides the messages: the special tokens
        (as ``apply_chat_template`` passes them) and ``chat_template_kwargs``."""
        variables: dict[str, Any] = dict(source.tokens)
        if not source.configured:
            # A bare tokenizer: the same name guesses as for the ids.
            tok = self.tokenizer
            for key, candidates in (("bos_token", BOS_TOKEN_CANDIDATES),
                                    ("eos_token", EOS_TOKEN_CANDIDATES)):
                found = next((t for t in candidates if tok.token_to_id(t) is not None), None)
                if found is not None:
                    variables[key] = found
        if extra is None:
            return variables
        if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
            raise ValueError(f"chat_template_kwargs must be a dict with str keys, got {extra!r}")
        reserved = sorted(set(extra) & set(RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {reserved}: the operator sets "
                             "them for each conversation")
        try:
            json.dumps(dict(extra), sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"chat_template_kwargs must hold JSON values (they enter the pipeline's "
                f"configuration), got {extra!r:.200} ({exc})"
            ) from exc
        variables.update(extra)
        return variables

    @property
    def _compiled(self) -> Any:
        """The compiled Jinja template, built once per process."""
        compiled = self._jinja
        if compiled is None:
            compiled = self._jinja = compile_jinja(self.chat_template,
                                                    str(self.chat_template_source))
        return compiled

    def _validate(self, messages: Any) -> str | None:
        """Why ``messages`` is malformed, or ``None`` when it is fine."""
        if not isinstance(messages, (list, tuple)):
            return f"{self.field!r} must be a list of messages, got {type(messages).__name__}"
        for k, msg in enumerate(messages):
            if not isinstance(msg, Mapping):
                return (f"message {k} must be a dict with 'role' and 'content', got "
                        f"{type(msg).__name__}")
            role = msg.get("role")
            if role not in self.roles:
                return f"message {k} has role {role!r}; expected one of {list(self.roles)}"
            content = msg.get("content")
            if not isinstance(content, str):
                return (f"message {k} ({role}) needs a str 'content', got "
                        f"{type(content).__name__}")
            if self.template_kind == "jinja" and GENERATION_MARK in content:
                return (f"message {k} ({role}) holds the text {GENERATION_MARK!r}, which "
                        "tokenize_chat uses to find generation blocks")
        return None

    def _segments(self, messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool]]:
        template = self.chat_template
        if self.template_kind == "format":
            segs: list[tuple[str, bool]] = []
            for msg in messages:
                role = msg["role"]
                segs.append((self._prefix.replace("{role}", role), False))
                segs.append((msg["content"], role == "assistant"))
                segs.append((self._suffix.replace("{role}", role), False))
            return segs
        segs = template(messages)
        if not isinstance(segs, (list, tuple)) or not all(
            isinstance(s, (tuple, list)) and len(s) == 2 and isinstance(s[0], str)
            and isinstance(s[1], (bool, np.bool_)) for s in segs
        ):
            raise ValueError(
                "chat_template callable must return a list of (text: str, is_assistant: bool) "
                f"pairs, got {segs!r:.200}"
            )
        return [(text, bool(flag)) for text, flag in segs]

    def _pieces(self, segs: list[tuple[str, bool]]) -> list[tuple[str | int, int]]:
        """Texts and special ids, each with its assistant-turn index (-1: not assistant)."""
        eos = self.eos_token_id
        pieces: list[tuple[str | int, int]] = []
        if self.bos_token_id is not None:
            pieces.append((self.bos_token_id, -1))
        turn = -1
        in_turn = False
        for text, is_assistant in segs:
            if is_assistant and not in_turn:
                turn += 1
            elif not is_assistant and in_turn and eos is not None:
                pieces.append((eos, turn))
            in_turn = bool(is_assistant)
            if text:
                pieces.append((text, turn if in_turn else -1))
        if in_turn and eos is not None:
            pieces.append((eos, turn))
        return pieces

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self._compiled.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt,
                                     tools=None, documents=None, **self._template_variables)

    def _rendered(self, messages: Sequence[Mapping[str, Any]]
                  ) -> tuple[str, list[tuple[int, int]]]:
        """A conversation through the Jinja template: the text, and the character span of
        each assistant turn in it.

        Raises:
            _Unlocatable: The template does not render the conversation prefix by
                prefix, so an assistant turn cannot be located.
        """
        plain = [dict(m) for m in messages]  # fresh dicts: the template sees plain data
        if self._generation_blocks:
            return split_generation_marks(self._render(plain, False))
        text = self._render(plain, False)
        spans = []
        for k, msg in enumerate(plain):
            if msg["role"] != "assistant":
                continue
            # The prompt up to the assistant header, then the same with the reply: the
            # reply is what the second adds to the first.
            head = self._render(plain[:k], True)
            upto = self._render(plain[:k + 1], False)
            if not (upto.startswith(head) and text.startswith(upto)):
                raise _Unlocatable(
                    f"the chat template ({self.chat_template_source}) does not render this "
                    f"conversation prefix by prefix: messages[:{k}] with the generation prompt, "
                    f"then messages[:{k + 1}], are not the start of the whole conversation, "
                    f"so the tokens of assistant message {k} cannot be located"
                )
            spans.append((len(head), len(upto)))
        return text, spans

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Render, tokenize (one batched call) and mask every live record."""
        if self.template_kind == "jinja":
            return self._process_jinja(elems)
        out: list[Element] = list(elems)
        jobs: list[tuple[int, list[tuple[str | int, int]]]] = []
        texts: list[str] = []
        for i, rec in self._live(elems, out):
            pieces = self._pieces(self._segments(rec.payload[self.field]))
            texts.extend(p for p, _ in pieces if isinstance(p, str))
            jobs.append((i, pieces))
        try:
            encoded = iter(self._encode(texts)) if texts else iter(())
        except Exception as exc:  # find the conversation(s) that cannot be encoded
            apart = self._encode_apart(
                [[p for p, _ in pieces if isinstance(p, str)] for _, pieces in jobs], exc)
            encoded = iter([ids for r in apart if not isinstance(r, Exception) for ids in r])
            kept = []
            for (i, pieces), result in zip(jobs, apart):
                if isinstance(result, Exception):
                    out[i] = self._reject(
                        elems[i], "tokenize_chat_error",
                        self._unencodable(elems[i].payload[self.field], result), cause=result)
                else:
                    kept.append((i, pieces))
            jobs = kept
        for i, pieces in jobs:
            id_lists = [next(encoded) if isinstance(p, str) else [p] for p, _ in pieces]
            out[i] = self._build(elems[i], pieces, id_lists)
        return out

    def _problem(self, payload: Any) -> str | None:
        """Why a payload holds no valid conversation, or None."""
        if not isinstance(payload, Mapping) or self.field not in payload:
            return f"has no field {self.field!r}"
        return self._validate(payload[self.field])

    def _live(self, elems: Sequence[Element], out: list[Element]
              ) -> Iterator[tuple[int, SampleRecord]]:
        """``(index, record)`` of each record to tokenize, in order; sentinels are
        skipped, and a record without a valid conversation is rejected in ``out``."""
        for i, rec in live_records(elems, self.name):
            problem = self._problem(rec.payload)
            if problem is not None:
                out[i] = self._reject(rec, "tokenize_chat_error", problem)
                continue
            yield i, rec

    def _process_jinja(self, elems: Sequence[Element]) -> list[Element]:
        """:meth:`process_many` with a Jinja template: render each conversation, tokenize
        the texts in one batched call, and mask the tokens that start in an assistant span."""
        out: list[Element] = list(elems)
        jobs: list[tuple[int, list[tuple[int, int]]]] = []
        texts: list[str] = []
        for i, rec in self._live(elems, out):
            try:
                text, spans = self._rendered(rec.payload[self.field])
            except _Unlocatable as exc:
                out[i] = self._reject(
                    rec, "tokenize_chat_error", str(exc),
                    "use a template that marks replies with {% generation %} ... "
                    "{% endgeneration %}, or chat_template=DEFAULT_CHAT_TEMPLATE or a callable")
                continue
            except Exception as exc:  # the template's own code failed on this conversation
                out[i] = self._reject(rec, "tokenize_chat_error", template_failure(exc),
                                      "fix the data or the template", cause=exc)
                continue
            texts.append(text)
            jobs.append((i, spans))
        try:
            encoded: list[Any] = self._encode_with_offsets(texts) if texts else []
        except Exception as exc:  # find the conversation(s) that cannot be encoded
            apart = self._encode_apart([[t] for t in texts], exc, self._encode_with_offsets)
            encoded = [r if isinstance(r, Exception) else r[0] for r in apart]
        for (i, spans), result in zip(jobs, encoded):
            if isinstance(result, Exception):
                out[i] = self._reject(
                    elems[i], "tokenize_chat_error",
                    self._unencodable(elems[i].payload[self.field], result), cause=result)
                continue
            ids, offsets = result
            if self.loss_on_last_turn_only:
                spans = spans[-1:]
            # A token is the assistant's when it covers any of a span's characters (as
            # transformers' assistant mask counts it): " The" after "Assistant:" is.
            flags = np.zeros(len(ids), dtype=bool)
            for start, end in spans:
                if end > start:
                    flags |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
            array = np.array(ids, dtype=np.int32)
            mask = flags.astype(np.uint8)
            if self.max_length is not None and len(array) > self.max_length:
                array, mask = array[: self.max_length], mask[: self.max_length]
            rec = elems[i]
            out[i] = SampleRecord(rec.meta, {**rec.payload, self.out_field: array,
                                             self.mask_field: mask})
        return out

    def process_block(self, block: Block) -> Block:
        """:meth:`process_many` on the block's records (conversations are rendered one by
        one), the ids and loss masks then held as ragged columns for the next stages."""
        out = Block.from_records(self.process_many(block.records()), lane=block.lane)
        return out.columnar()

    @staticmethod
    def _unencodable(messages: Sequence[Mapping[str, Any]], exc: Exception) -> str:
        """What is wrong with a (valid) conversation the tokenizer cannot encode."""
        for k, msg in enumerate(messages):
            if _lone_surrogate(msg["content"]) is not None:
                return unencodable(f"the content of message {k} ({msg['role']})",
                                    msg["content"], exc)
        return unencodable("the rendered conversation", "", exc)

    def _build(self, rec: SampleRecord, pieces: list[tuple[str | int, int]],
               id_lists: list[list[int]]) -> SampleRecord:
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        total = int(lengths.sum())
        ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=total)
        turns = np.fromiter((t for _, t in pieces), dtype=np.int64, count=len(pieces))
        if self.loss_on_last_turn_only:
            flags = (turns >= 0) & (turns == turns.max(initial=-1))
        else:
            flags = turns >= 0
        mask = np.repeat(flags.astype(np.uint8), lengths)
        if self.max_length is not None and total > self.max_length:
            ids, mask = ids[: self.max_length].copy(), mask[: self.max_length].copy()
        return SampleRecord(rec.meta, {**rec.payload, self.out_field: ids, self.mask_field: mask})

    def config(self) -> dict[str, Any]:
        """Parameters that define the output (a callable template by its code hash, a
        Jinja one by the SHA-256 of its text, with the variables it is rendered with)."""
        template = self.chat_template
        if self.template_kind == "jinja":
            described: Any = {
                "jinja_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest()}
        elif self.template_kind == "format":
            described = template
        else:
            described = callable_config(template)
        config = {
            **super().config(),
            "field": self.field,
            "out_field": self.out_field,
            "mask_field": self.mask_field,
            "chat_template": described,
            "loss_on_last_turn_only": self.loss_on_last_turn_only,
            "roles": list(self.roles),
            **self._tokenizer_config(),
        }
        if self.template_kind == "jinja":
            config["chat_template_variables"] = dict(sorted(self._template_variables.items()))
        return config

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_jinja"] = None  # compiled again from the text in the receiving process
        return state
