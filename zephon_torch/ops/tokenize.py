"""Tokenization operators: ``tokenize`` (plain text) and ``tokenize_chat``.

Both are stateless: the default counting accumulator cuts the stream into
micro-batches of 512 records, and ``process_many`` encodes one micro-batch with
a single ``encode_batch`` call (the Rust tokenizer spreads it over its own
threads, which keep each other busier on a long list of texts than on a
short one: 512 tokenizes about 8% faster than 128 on two cores), then writes
the ids as an ``int32`` numpy array into a shallow copy of each payload. The
meta is kept, so identity and order survive.

A text the tokenizer cannot encode (a lone UTF-16 surrogate, which is not
Unicode) makes the batched call fail; the operator then encodes each sample
on its own to find the failing one(s), so what fails (an error naming the
sample's file and line, or with ``on_error="skip"`` a tombstone) depends on
the sample alone, never on its neighbours or the micro-batch size.

Special tokens are added by the operator, not by the tokenizer's
post-processor: texts are encoded with ``add_special_tokens=False`` and BOS/EOS
ids are placed around them according to ``special_tokens``. The default is
``"eos"``: one EOS after each document, which is what packing for pretraining
needs (exactly one separator between packed documents, whatever the
tokenizer; a post-processor adds nothing for GPT-2, only BOS for Llama). With
``max_length`` the body is cut so the result fits, BOS still first and EOS
still last::

    text "the lane"  ->  encode -> [412, 530]
    special_tokens="eos" (eos=0), the default    -> [412, 530, 0]
    special_tokens="bos_eos" (bos=1, eos=0)      -> [1, 412, 530, 0]
    special_tokens="bos_eos", max_length=3       -> [1, 412, 0]
    special_tokens="none"                        -> [412, 530]

The ids of BOS and EOS come from the tokenizer's own configuration when it has
one (a transformers tokenizer's ``eos_token_id``, the ``eos_token`` of a
directory's ``tokenizer_config.json``); only a tokenizer without one (a bare
``tokenizers.Tokenizer``, a ``tokenizer.json`` path) has them guessed from
token names (:data:`EOS_TOKEN_CANDIDATES`, :data:`BOS_TOKEN_CANDIDATES`).

Chat samples (``tokenize_chat``) with the built-in template or a callable are
rendered into segments, each tokenized on its own so the ``loss_mask`` lines
up exactly with the tokens: 1 on assistant content and the EOS that ends each
assistant turn, 0 elsewhere. With the default template
``"<|{role}|>\\n{content}\\n"``::

    segment            "<|user|>\\n"  "Hi"  "\\n"  "<|assistant|>\\n"  "Hello"  EOS  "\\n"
    loss_mask               0          0     0          0              1      1    0

With the model's own Jinja template (from the tokenizer directory or the
transformers tokenizer), the conversation is rendered as transformers renders
it and tokenized as one text; the mask is 1 on the tokens that start inside an
assistant span (a ``{% generation %}`` block, or what the assistant message
adds after the generation prompt when the conversation is rendered prefix by
prefix).

Why the tokenizer travels as JSON. An operator is pickled to worker
processes; the Rust tokenizer object is not something to pickle by reference.
The operator keeps the tokenizer's JSON (``Tokenizer.to_str()``) and each
process rebuilds it once, lazily, on first use (it is left out of the pickled
state). The JSON is normalized first: padding and truncation are switched
off, because padding to the longest text of a micro-batch would make a
sample's ids depend on its neighbours (breaking the stateless contract), and
``max_length`` is the operator's own truncation knob. Its SHA-256 enters the
configuration fingerprint.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from tokenizers import Tokenizer

from zephon_torch.block import Block, Ragged
from zephon_torch.ops.base import Element, OpContext, Operator, OpTraits, tombstone
from zephon_torch.ops.io import _lone_surrogate
from zephon_torch.ops.placement import set_placement
from zephon_torch.ops.transform import _check_record, callable_config
from zephon_torch.sources.base import Dataset
from zephon_torch.types import SampleRecord
from zephon_torch.vocab import TOMBSTONE_DETAIL_TAG, TOMBSTONE_REASON_TAG

__all__ = [
    "BOS_TOKEN_CANDIDATES",
    "CHAT_ROLES",
    "DEFAULT_CHAT_TEMPLATE",
    "EOS_TOKEN_CANDIDATES",
    "SPECIAL_TOKEN_MODES",
    "Tokenize",
    "TokenizeChat",
    "is_jinja_template",
]

#: Accepted values of ``special_tokens``.
SPECIAL_TOKEN_MODES: tuple[str, ...] = ("bos_eos", "eos", "bos", "none")
#: Tokens tried, in order, when no ``eos_token_id`` is given.
EOS_TOKEN_CANDIDATES: tuple[str, ...] = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
#: Tokens tried, in order, when no ``bos_token_id`` is given.
BOS_TOKEN_CANDIDATES: tuple[str, ...] = ("<s>", "<bos>", "<|begin_of_text|>", "<|endoftext|>")
#: Roles ``tokenize_chat`` accepts by default.
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
#: The built-in per-turn chat format (``{role}`` and ``{content}`` placeholders).
DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"

_ON_ERROR = ("raise", "skip")
# Which special tokens each mode adds.
_WANTS: dict[str, tuple[str, ...]] = {
    "bos_eos": ("bos", "eos"), "eos": ("eos",), "bos": ("bos",), "none": (),
}

#: A chat template callable: ``messages -> [(text, is_assistant), ...]``.
ChatTemplate = Callable[[Sequence[Mapping[str, Any]]], Sequence[tuple[str, bool]]]


#: Token names a tokenizer's own configuration may define (transformers' names).
_SPECIAL_TOKEN_KEYS: tuple[str, ...] = (
    "bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token",
)


@dataclass(frozen=True)
class _TokenizerSource:
    """What a ``tokenizer`` argument provides besides its ``tokenizer.json``.

    Attributes:
        json: The tokenizer's JSON, padding and truncation switched off.
        described: How messages name it ("the tokenizer directory 'tok'").
        tokens: Special-token texts from its own configuration
            (``tokenizer_config.json``/``special_tokens_map.json`` of a
            directory, or a transformers tokenizer's attributes): empty for a
            bare ``tokenizers.Tokenizer`` or a ``tokenizer.json`` path.
        tokens_from: Where ``tokens`` come from (for messages), or None.
        ids: A transformers tokenizer's own ``bos_token_id``/``eos_token_id``/...
        configured: Whether the tokenizer comes with a configuration of its
            special tokens (a directory with a config file, a transformers
            tokenizer): then ids are never guessed from token names.
        chat_template: Its own chat template as stored (a Jinja string, or
            transformers' set of named templates), if any: only
            :class:`TokenizeChat` reads it (:func:`_template_of`).
        chat_template_from: Where the chat template comes from, or None.
    """

    json: str
    described: str
    tokens: Mapping[str, str]
    tokens_from: str | None
    ids: Mapping[str, int]
    configured: bool
    chat_template: Any
    chat_template_from: str | None


def _read_config_file(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, None when the file is absent."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(path)!r} ({exc}); it must be the JSON file "
                         "save_pretrained() writes (or delete it to use tokenizer.json alone)"
                         ) from exc
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} holds a {type(data).__name__}, not a JSON object; it "
                         "must be the JSON file save_pretrained() writes")
    return data


def _token_text(value: Any, key: str, where: str) -> str | None:
    """A special token's text: a string, or transformers' serialized ``AddedToken``."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{key} in {where} is {value!r}, not a token string (or an AddedToken "
                         "object with a 'content' string)")
    return value or None


def _template_of(value: Any, where: str) -> str | None:
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


def _from_directory(directory: Path) -> tuple[dict[str, str], str | None, bool, Any,
                                              str | None]:
    """Special tokens and chat template of a tokenizer directory (``save_pretrained``)."""
    config = _read_config_file(directory / "tokenizer_config.json")
    token_map = _read_config_file(directory / "special_tokens_map.json")
    tokens: dict[str, str] = {}
    sources = []
    # tokenizer_config.json is where current transformers writes the tokens;
    # special_tokens_map.json (older releases) fills in what it leaves out.
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", token_map)):
        if data is None:
            continue
        sources.append(name)
        where = f"{str(directory / name)!r}"
        for key in _SPECIAL_TOKEN_KEYS:
            if key not in tokens:
                text = _token_text(data.get(key), key, where)
                if text is not None:
                    tokens[key] = text
    tokens_from = (f"{' and '.join(sources)} in the tokenizer directory {str(directory)!r}"
                   if sources else None)
    template = template_from = None
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            template = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the chat template {str(jinja_file)!r} ({exc})"
                             ) from exc
        template_from = f"{str(jinja_file)!r}"
    elif config is not None and config.get("chat_template") is not None:
        template = config["chat_template"]
        template_from = f"{str(directory / 'tokenizer_config.json')!r}"
    return tokens, tokens_from, bool(sources), template, template_from


def _load_tokenizer(tokenizer: Any) -> _TokenizerSource:
    """The tokenizer's JSON (padding and truncation off) and its own configuration."""
    where = ""
    tokens: dict[str, str] = {}
    ids: dict[str, int] = {}
    tokens_from = template = template_from = None
    configured = False
    if isinstance(tokenizer, Tokenizer):
        raw = tokenizer.to_str()
        described = "the tokenizers.Tokenizer"
    elif isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        directory = path if path.is_dir() else None
        if directory is not None:
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist; pass the "
                                    "path of a tokenizer.json (or of a folder holding one)")
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the tokenizer file {str(path)!r} ({exc}); it must be "
                             "a tokenizer.json saved by tokenizers or transformers") from exc
        where = f" from {str(path)!r}"
        if directory is not None:
            described = f"the tokenizer directory {str(directory)!r}"
            tokens, tokens_from, configured, template, template_from = _from_directory(
                directory)
        else:
            described = f"the tokenizer file {str(path)!r}"
    elif isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer):
        # A transformers fast tokenizer wraps a tokenizers.Tokenizer and knows its own
        # special tokens and chat template.
        raw = tokenizer.backend_tokenizer.to_str()
        described = f"the transformers tokenizer ({type(tokenizer).__name__})"
        configured = True
        tokens_from = described
        for key in _SPECIAL_TOKEN_KEYS:
            text = getattr(tokenizer, key, None)
            if isinstance(text, str) and text:
                tokens[key] = text
            known = getattr(tokenizer, f"{key}_id", None)
            if isinstance(known, (int, np.integer)) and not isinstance(known, bool) and known >= 0:
                ids[key] = int(known)
        template = getattr(tokenizer, "chat_template", None)
        if template is not None:
            template_from = described
    else:
        raise TypeError(
            "tokenizer must be a tokenizers.Tokenizer, a path to a tokenizer.json or to a "
            "tokenizer directory, or a transformers fast tokenizer (with backend_tokenizer), "
            f"got {type(tokenizer).__name__}"
        )
    try:
        tok = Tokenizer.from_str(raw)
    except Exception as exc:  # the Rust side raises a bare Exception
        raise ValueError(
            f"could not load the tokenizer{where}: {exc}; the file must be a complete "
            "tokenizer.json (save one with Tokenizer.save() or tokenizer.save_pretrained()); a "
            "truncated or hand-edited file, or a slow (sentencepiece) tokenizer, will not load"
        ) from exc
    tok.no_padding()
    tok.no_truncation()
    return _TokenizerSource(tok.to_str(), described, tokens, tokens_from, ids, configured,
                            template, template_from)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_field_name(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def _special_id(tok: Tokenizer, source: _TokenizerSource, which: str, explicit: Any,
                candidates: tuple[str, ...]) -> tuple[int | None, str]:
    """The id of the ``which`` ("bos", "eos", "pad") token, and where it came from (or,
    when there is none, what was looked at).

    In order: the explicit argument; a transformers tokenizer's own
    ``<which>_token_id``; the token its configuration names
    (``tokenizer_config.json``/``special_tokens_map.json`` of a directory);
    and only for a tokenizer without any configuration (a bare
    ``tokenizers.Tokenizer``, a ``tokenizer.json`` path, a directory holding
    nothing else), the first of ``candidates`` found in the vocabulary.
    """
    arg = f"{which}_token_id"
    key = f"{which}_token"
    if explicit is not None:
        if not isinstance(explicit, (int, np.integer)) or isinstance(explicit, bool):
            raise ValueError(f"{arg} must be an int, got {explicit!r}")
        vocab = tok.get_vocab_size(with_added_tokens=True)
        if not 0 <= int(explicit) < vocab:
            raise ValueError(
                f"{arg}={explicit} is outside the tokenizer's vocabulary [0, {vocab})"
            )
        return int(explicit), f"the {arg} argument"
    if key in source.ids:
        return source.ids[key], f"{source.described}'s {arg}"
    text = source.tokens.get(key)
    if text is not None:
        found = tok.token_to_id(text)
        if found is None:
            raise ValueError(
                f"{key} {text!r} named in {source.tokens_from} is not in the tokenizer's "
                f"vocabulary; pass {arg}=<id>, or fix the configuration"
            )
        return int(found), f"{key} {text!r} in {source.tokens_from}"
    if source.configured:
        return None, f"{source.tokens_from} names no {key}; token names are not guessed"
    for token in candidates:
        found = tok.token_to_id(token)
        if found is not None:
            return int(found), (f"the token {token!r}, found by name: {source.described} "
                                "comes without a tokenizer_config.json")
    return None, (f"looked for {list(candidates)} by name: {source.described} comes without "
                  "a tokenizer_config.json")


class _TokenizerOperator(Operator):
    """Shared machinery: the tokenizer as JSON, its lazy rebuild, special ids."""

    #: Between the sample id and the problem in error messages.
    _separator: ClassVar[str] = " "

    def traits(self) -> OpTraits:
        """Elementwise: consecutive elementwise stages may be fused."""
        return OpTraits(elementwise=True)

    def _init_tokenizer(self, tokenizer: Any, *, special_tokens: str,
                        bos_token_id: int | None, eos_token_id: int | None,
                        on_error: str) -> _TokenizerSource:
        """Load the tokenizer and resolve the special ids ``special_tokens`` needs.

        Returns what the tokenizer argument provides (its configured special
        tokens and chat template), for :class:`TokenizeChat`.
        """
        _check_choice("special_tokens", special_tokens, SPECIAL_TOKEN_MODES)
        _check_choice("on_error", on_error, _ON_ERROR)
        source = (tokenizer if isinstance(tokenizer, _TokenizerSource)
                  else _load_tokenizer(tokenizer))
        self._tokenizer_json = source.json
        self.tokenizer_sha256 = hashlib.sha256(self._tokenizer_json.encode("utf-8")).hexdigest()
        self._tok: Tokenizer | None = None
        self._datasets: dict[int, Dataset] | None = None
        self.special_tokens = special_tokens
        self.on_error = on_error
        tok = self.tokenizer
        self.bos_token_id = self.eos_token_id = None
        #: Where each resolved special id came from, e.g. ``{"eos": "eos_token '</s>' in
        #: tokenizer_config.json in the tokenizer directory 'tok'"}``.
        self.special_token_sources: dict[str, str] = {}
        missing = []
        for which, explicit, candidates in (("bos", bos_token_id, BOS_TOKEN_CANDIDATES),
                                            ("eos", eos_token_id, EOS_TOKEN_CANDIDATES)):
            if which not in _WANTS[special_tokens]:
                if explicit is not None:
                    # Never ignore an id given on purpose (code written when the default
                    # was "bos_eos" would silently lose its BOS).
                    raise ValueError(
                        f"{which}_token_id={explicit!r} is given, but special_tokens="
                        f"{special_tokens!r} adds no {which.upper()}; pass special_tokens="
                        f"'bos_eos' (or {which!r}) to add it, or leave {which}_token_id out"
                    )
                continue
            found, where = _special_id(tok, source, which, explicit, candidates)
            if found is None:
                missing.append(f"no {which.upper()} token ({where}); pass {which}_token_id=<id>")
            else:
                self.special_token_sources[which] = where
            setattr(self, f"{which}_token_id", found)
        if missing:
            raise ValueError(
                f"special_tokens={special_tokens!r} needs special token ids that "
                f"{source.described} does not name: {'; '.join(missing)} (or choose another "
                "special_tokens mode)"
            )
        #: The tokenizer's own pad id (from its configuration; None when it names none):
        #: e.g. for ``pack_flat(pad_token_id=...)``. Never guessed, never in the output.
        self.pad_token_id = None
        if source.configured:
            try:
                self.pad_token_id = _special_id(tok, source, "pad", None, ())[0]
            except ValueError:  # a pad token outside the vocabulary: not needed here
                self.pad_token_id = None
        return source

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, rebuilt from its JSON once per process."""
        tok = self._tok
        if tok is None:
            # Two threads may both get here; each builds an equal tokenizer
            # and one of them is kept, which is harmless.
            tok = self._tok = Tokenizer.from_str(self._tokenizer_json)
        return tok

    def setup(self, ctx: OpContext) -> None:
        """Build the tokenizer now rather than inside the first micro-batch, and take
        the plan's datasets (``ctx.plan["datasets"]``, when there is a plan) to name
        the file and line of a bad sample."""
        _ = self.tokenizer
        datasets = ctx.plan.get("datasets") if ctx.plan else None
        self._datasets = dict(datasets) if isinstance(datasets, Mapping) else None

    def _encode(self, texts: list[str]) -> list[list[int]]:
        tok = self.tokenizer
        # encode_batch_fast (tokenizers >= 0.20) skips offset tracking we do not use.
        encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        return [enc.ids for enc in encode(texts, add_special_tokens=False)]

    def _encode_with_offsets(self, texts: list[str]
                             ) -> list[tuple[list[int], np.ndarray]]:
        """Ids, and the ``[start, end)`` characters each token covers (``[n, 2]``)."""
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [(enc.ids, np.array(enc.offsets, dtype=np.int64).reshape(-1, 2))
                for enc in encoded]

    def _encode_apart(self, groups: list[list[str]], failure: Exception,
                      encode: Callable[[list[str]], list[Any]] | None = None,
                      ) -> list[list[Any] | Exception]:
        """After a batched encode failed: encode each group (one sample's texts) on
        its own; a group that cannot be encoded gets its exception instead of ids.

        Whether a sample fails then depends on its texts alone, never on its
        neighbours in the micro-batch (or the micro-batch size).

        Raises:
            RuntimeError: Every group encodes on its own, so the failure was not
                in the data.
        """
        encode = encode or self._encode
        results: list[list[Any] | Exception] = []
        for texts in groups:
            try:
                results.append(encode(texts) if texts else [])
            except Exception as exc:  # the Rust side raises TypeError, ValueError, Exception
                results.append(exc)
        if not any(isinstance(r, Exception) for r in results):
            raise RuntimeError(
                f"{self.name}: the tokenizer failed on a micro-batch of {len(groups)} samples "
                f"({type(failure).__name__}: {failure}), yet each of them encodes on its own"
            ) from failure
        return results

    def _reject(self, rec: SampleRecord, reason: str, problem: str, fix: str = "fix the data",
                cause: BaseException | None = None) -> SampleRecord:
        """A tombstone (``on_error="skip"``), or a ``ValueError`` naming the sample, its
        file and line when the plan knows them, and which ``on_error`` would skip it."""
        meta = rec.meta
        head = f"{self.name}: sample {meta.sample_id}{self._separator}{problem}"
        if self.on_error == "skip":
            return tombstone(rec, reason, head[:300])
        dataset = self._dataset_of(meta.sample_id)
        where = ""
        if dataset is not None:
            try:
                where = f", at {dataset.locate(meta.sample_id[1], meta.sample_id[2])}"
            except Exception:  # a location is a courtesy: never hide the real problem
                where = ""
        advice = f"pass {self.name}(..., on_error='skip') to drop such samples"
        if dataset is not None and getattr(dataset, "on_error", "raise") == "skip":
            # The source's on_error reaches fetch and decode_text, not the tokenizers.
            advice += (f" (the source's on_error='skip' covers only fetch and decode_text, "
                       f"not {self.name})")
        raise ValueError(f"{head}{where}; {fix}, or {advice}") from cause

    def _dataset_of(self, sample_id: Any) -> Dataset | None:
        datasets = getattr(self, "_datasets", None)
        if not datasets or not isinstance(sample_id, tuple) or len(sample_id) != 3:
            return None
        return datasets.get(sample_id[0])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tok"] = None  # rebuilt from _tokenizer_json in the receiving process
        state["_datasets"] = None  # each process's setup(ctx) takes them from its plan
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _no_text(payload: Any, field: str, text: Any) -> str:
    """What is wrong with a payload that holds no string under ``field``."""
    if isinstance(payload, Mapping) and field in payload:
        return f"field {field!r} is a {type(text).__name__}, not a str"
    if isinstance(payload, Mapping):
        return f"has no field {field!r} (fields: {sorted(map(str, payload))})"
    return f"payload is a {type(payload).__name__}, not a dict with {field!r}"


class Tokenize(_TokenizerOperator):
    """Encode a text field into an ``int32`` array of token ids.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``, a path to a ``tokenizer.json``,
            a tokenizer directory (``save_pretrained``: ``tokenizer.json``
            plus ``tokenizer_config.json``), or a transformers fast tokenizer
            (anything with a ``backend_tokenizer``).
        field: Payload key holding the text.
        out_field: Payload key that receives the ids.
        special_tokens: ``"eos"`` (the default: one EOS after each text, so
            packed documents are separated by exactly one token),
            ``"bos_eos"``, ``"bos"`` or ``"none"``.
        bos_token_id: BOS id; by default the tokenizer's own: a transformers
            tokenizer's ``bos_token_id``, the ``bos_token`` a directory's
            ``tokenizer_config.json`` (or ``special_tokens_map.json``) names,
            and only for a tokenizer without such a configuration, the first
            of :data:`BOS_TOKEN_CANDIDATES` in the vocabulary.
        eos_token_id: EOS id, found the same way (``eos_token``,
            :data:`EOS_TOKEN_CANDIDATES`).
        max_length: Keep at most this many ids, special tokens included (BOS
            stays first, EOS stays last).
        on_error: A payload without a string ``field``, or a text the
            tokenizer cannot encode (a lone UTF-16 surrogate): ``"raise"`` a
            ``ValueError`` naming the sample and, within a pipeline, its file
            and line, or ``"skip"`` it as a tombstone with reason
            ``"tokenize_error"``. The source's ``on_error`` does not reach
            this operator.
        placement: ``"local"``, ``"remote"`` or a ``Remote(...)``: where
            ``process_many`` runs (``docs/remote-stages.md``); not part of
            :meth:`config`.

    Raises:
        ValueError: An unknown mode, a missing special token, or a
            ``max_length`` too small for the special tokens.
        TypeError: ``tokenizer`` is none of the accepted kinds.
        FileNotFoundError: ``tokenizer`` is a path that does not exist.
    """

    name = "tokenize"
    default_microbatch_size = 512

    def __init__(self, tokenizer: Any, *, field: str = "text", out_field: str = "input_ids",
                 special_tokens: str = "eos", bos_token_id: int | None = None,
                 eos_token_id: int | None = None, max_length: int | None = None,
                 on_error: str = "raise", placement: Any = "local") -> None:
        _check_field_name("field", field)
        _check_field_name("out_field", out_field)
        set_placement(self, placement)
        self._init_tokenizer(tokenizer, special_tokens=special_tokens,
                             bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                             on_error=on_error)
        self.field = field
        self.out_field = out_field
        n_special = (self.bos_token_id is not None) + (self.eos_token_id is not None)
        if max_length is not None:
            if (not isinstance(max_length, int) or isinstance(max_length, bool)
                    or max_length < max(1, n_special)):
                raise ValueError(
                    f"max_length must be an int >= {max(1, n_special)} (room for the special "
                    f"tokens of special_tokens={special_tokens!r}) or None, got {max_length!r}"
                )
        self.max_length = max_length
        self._n_special = n_special

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Tokenize every live record of the micro-batch with one batched call."""
        field = self.field
        out: list[Element] = list(elems)
        texts: list[str] = []
        where: list[int] = []
        for i, rec in enumerate(elems):
            if type(rec) is not SampleRecord:
                _check_record(rec, self.name)
            meta = rec.meta
            if meta.tags and meta.is_sentinel:
                continue
            payload = rec.payload
            text = payload.get(field) if isinstance(payload, Mapping) else None
            if isinstance(text, str):
                texts.append(text)
                where.append(i)
                continue
            out[i] = self._reject(rec, "tokenize_error", _no_text(payload, field, text),
                                  "fix the data, set field=...")
        if texts:
            out_field = self.out_field
            try:
                encoded: list[Any] = self._encode(texts)
            except Exception as exc:  # find the text(s) that cannot be encoded
                encoded = [r if isinstance(r, Exception) else r[0]
                           for r in self._encode_apart([[t] for t in texts], exc)]
            for i, text, ids in zip(where, texts, encoded):
                rec = out[i]
                if isinstance(ids, Exception):
                    out[i] = self._reject(rec, "tokenize_error",
                                          _unencodable(f"field {field!r}", text, ids), cause=ids)
                    continue
                out[i] = SampleRecord(rec.meta, {**rec.payload, out_field: self._to_array(ids)})
        return out

    def process_block(self, block: Block) -> Block:
        """:meth:`process_many` for a block: one encode call, the ids as one ragged column.

        Dict payloads that share their keys (the usual case) stay columns,
        with the ids as a :class:`~zephon_torch.block.Ragged` column under
        ``out_field``; the records a block view gives are those of
        :meth:`process_many`.
        """
        n = len(block)
        field = self.field
        dead = block.tomb
        fields = block.fields
        if fields is not None and isinstance(fields.get(field), list):
            texts_in: list[Any] = fields[field]
            payloads = None
        else:
            payloads = block.payload_list()
            texts_in = [p.get(field) if isinstance(p, Mapping) else None for p in payloads]
        live = [i for i in range(n)
                if (dead is None or not dead[i]) and isinstance(texts_in[i], str)]
        bad = [i for i in range(n) if (dead is None or not dead[i]) and
               not isinstance(texts_in[i], str)]
        texts = [texts_in[i] for i in live]
        encoded: list[Any] = []
        if texts:
            try:
                encoded = self._encode(texts)
            except Exception as exc:  # find the text(s) that cannot be encoded
                encoded = [r if isinstance(r, Exception) else r[0]
                           for r in self._encode_apart([[t] for t in texts], exc)]
        rejected: dict[int, SampleRecord] = {}
        for i in bad:
            problem = _no_text(block.payload(i), field, texts_in[i])
            rejected[i] = self._reject(block.record(i), "tokenize_error", problem,
                                       "fix the data, set field=...")
        rows: list[np.ndarray | None] = [None] * n
        for i, ids in zip(live, encoded):
            if isinstance(ids, Exception):
                rejected[i] = self._reject(
                    block.record(i), "tokenize_error",
                    _unencodable(f"field {field!r}", texts_in[i], ids), cause=ids)
                continue
            rows[i] = ids
        column = self._ragged(rows)
        result = self._with_ids(block, payloads, column)
        if rejected:
            mask = np.zeros(n, dtype=bool)
            mask[list(rejected)] = True
            reasons: list[str | None] = [None] * n
            details: list[str | None] = [None] * n
            for i, record in rejected.items():
                reasons[i] = record.meta.tags.get(TOMBSTONE_REASON_TAG)
                details[i] = record.meta.tags.get(TOMBSTONE_DETAIL_TAG)
            result = result.with_tombstones(mask, reasons, details)
        return result

    def _ragged(self, rows: list[Any]) -> Ragged:
        """The ids of each row (``None``: no ids) as one int32 column, special tokens added."""
        bos, eos = self.bos_token_id, self.eos_token_id
        room = None if self.max_length is None else self.max_length - self._n_special
        bodies = [0 if r is None else (len(r) if room is None else min(len(r), room))
                  for r in rows]
        lengths = np.array(bodies, dtype=np.int64)
        has = np.fromiter((r is not None for r in rows), dtype=bool, count=len(rows))
        lengths[has] += self._n_special
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.empty(int(offsets[-1]), dtype=np.int32)
        start = 0 if bos is None else 1
        for i, (ids, body) in enumerate(zip(rows, bodies)):
            if ids is not None and body:
                at = int(offsets[i]) + start
                values[at:at + body] = ids if body == len(ids) else ids[:body]
        firsts, lasts = offsets[:-1][has], offsets[1:][has] - 1
        if bos is not None:
            values[firsts] = bos
        if eos is not None:
            values[lasts] = eos
        return Ragged(values, offsets)

    def _with_ids(self, block: Block, payloads: list[Any] | None, column: Ragged) -> Block:
        """The block with ``out_field`` set on every data row's payload."""
        out_field = self.out_field
        if block.fields is not None and payloads is None:
            fields = dict(block.fields)
            fields[out_field] = column
            return block.with_fields(fields)
        assert payloads is not None
        dead = block.tomb
        keys = None
        same = True
        for i, p in enumerate(payloads):
            if dead is not None and dead[i]:
                continue
            if type(p) is not dict:
                same = False
                break
            if keys is None:
                keys = p.keys()
            elif p.keys() != keys:
                same = False
                break
        if same and keys is not None:
            names = list(keys)
            fields = {name: [None if p is None else p[name] for p in payloads] for name in names}
            fields[out_field] = column
            return block.with_fields(fields)
        views = column.rows()
        new = [p if (dead is not None and dead[i]) or not isinstance(p, Mapping)
               else {**p, out_field: views[i]} for i, p in enumerate(payloads)]
        return block.with_payloads(new)

    def _to_array(self, ids: list[int]) -> np.ndarray:
        bos, eos = self.bos_token_id, self.eos_token_id
        if self.max_length is not None:
            room = self.max_length - self._n_special
            if len(ids) > room:
                ids = ids[:room]
        if bos is None and eos is None:
            return np.array(ids, dtype=np.int32)
        # One C-level copy of the body into a preallocated array; the special
        # ids are written into their reserved slots.
        start = 0 if bos is None else 1
        arr = np.empty(len(ids) + self._n_special, dtype=np.int32)
        arr[start:start + len(ids)] = ids
        if bos is not None:
            arr[0] = bos
        if eos is not None:
            arr[-1] = eos
        return arr

    def config(self) -> dict[str, Any]:
        """Parameters that define the output, with the resolved special ids."""
        return {
            **super().config(),
            "field": self.field,
            "out_field": self.out_field,
            "special_tokens": self.special_tokens,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "max_length": self.max_length,
            "on_error": self.on_error,
            "tokenizer_sha256": self.tokenizer_sha256,
        }


def _unencodable(what: str, text: str, exc: Exception) -> str:
    """Why ``text`` (described by ``what``) cannot be tokenized."""
    surrogate = _lone_surrogate(text)
    if surrogate is not None:
        return (f"{what} holds a lone UTF-16 surrogate {surrogate} (not valid Unicode, so "
                "the tokenizer cannot encode it; often half of an emoji cut by a scraper)")
    return f"{what} cannot be tokenized ({type(exc).__name__}: {exc})"


#: Wrapped around what a ``{% generation %}`` block renders, then removed again: the
#: characters between them are the assistant's (NUL bytes, so no real text holds them).
_GENERATION_OPEN = "\x00zephon-generation-open\x00"
_GENERATION_CLOSE = "\x00zephon-generation-close\x00"
_GENERATION_MARK = "\x00zephon-generation-"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
#: Template variables the operator sets itself (chat_template_kwargs cannot).
_RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt")


def is_jinja_template(template: str) -> bool:
    """Whether a ``chat_template`` string is Jinja (``{% ... %}`` or ``{{ ... }}``) rather
    than the per-message format string of :data:`DEFAULT_CHAT_TEMPLATE`."""
    return "{%" in template or "{{" in template


def _compile_jinja(source: str, where: str) -> Any:
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


def _split_generation_marks(marked: str) -> tuple[str, list[tuple[int, int]]]:
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


class _Unlocatable(Exception):
    """The template does not render a conversation prefix by prefix."""


class TokenizeChat(_TokenizerOperator):
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

    def __init__(self, tokenizer: Any, *, field: str = "messages", out_field: str = "input_ids",
                 mask_field: str = "loss_mask", chat_template: str | ChatTemplate | None = None,
                 loss_on_last_turn_only: bool = False, roles: Sequence[str] = CHAT_ROLES,
                 special_tokens: str | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, max_length: int | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 on_error: str = "raise", placement: Any = "local") -> None:
        for name, value in (("field", field), ("out_field", out_field),
                            ("mask_field", mask_field)):
            _check_field_name(name, value)
        set_placement(self, placement)
        if out_field == mask_field:
            raise ValueError(f"out_field and mask_field must differ, both are {out_field!r}")
        source = _load_tokenizer(tokenizer)
        jinja: str | None = None
        template_from: str | None = None
        if chat_template is None:
            template: Any = DEFAULT_CHAT_TEMPLATE
            own = _template_of(source.chat_template, str(source.chat_template_from))
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
            self._generation_blocks = bool(_GENERATION_TAG.search(jinja))
            _ = self._compiled  # a syntax error is reported now, not on the first sample
        elif chat_template_kwargs is not None:
            raise ValueError(
                "chat_template_kwargs are variables of a Jinja chat template, but the chat "
                f"template here is a {self.template_kind} one; leave them out"
            )

    def _jinja_variables(self, source: _TokenizerSource,
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
        reserved = sorted(set(extra) & set(_RESERVED_TEMPLATE_VARIABLES))
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
            compiled = self._jinja = _compile_jinja(self.chat_template,
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
            if self.template_kind == "jinja" and _GENERATION_MARK in content:
                return (f"message {k} ({role}) holds the text {_GENERATION_MARK!r}, which "
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
            return _split_generation_marks(self._render(plain, False))
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
        for i, rec in enumerate(elems):
            if type(rec) is not SampleRecord:
                _check_record(rec, self.name)
            meta = rec.meta
            if meta.tags and meta.is_sentinel:
                continue
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
                out[i] = self._reject(rec, "tokenize_chat_error", _template_failure(exc),
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
                return _unencodable(f"the content of message {k} ({msg['role']})",
                                    msg["content"], exc)
        return _unencodable("the rendered conversation", "", exc)

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
            "special_tokens": self.special_tokens,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "max_length": self.max_length,
            "on_error": self.on_error,
            "tokenizer_sha256": self.tokenizer_sha256,
        }
        if self.template_kind == "jinja":
            config["chat_template_variables"] = dict(sorted(self._template_variables.items()))
        return config

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_jinja"] = None  # compiled again from the text in the receiving process
        return state


def _template_failure(exc: Exception) -> str:
    """What to say when a Jinja template raises on a conversation."""
    text = f"the chat template failed on it ({type(exc).__name__}: {exc})"
    if "strftime_now" in str(exc):
        text += ("; strftime_now (the current date) is left out so that the output does not "
                 "change from day to day: pass the date the template wants through "
                 "chat_template_kwargs (e.g. {'date_string': '26 Jul 2024'})")
    return text
