"""Tokenizer loading: what a ``tokenizer`` argument holds, as one JSON and its settings.

The tokenizing operators take a ``tokenizers.Tokenizer``, a path to a
``tokenizer.json``, a tokenizer directory (``save_pretrained``:
``tokenizer.json`` plus ``tokenizer_config.json`` and perhaps
``special_tokens_map.json`` and ``chat_template.jinja``), or a transformers
fast tokenizer (anything with a ``backend_tokenizer``). :func:`load_tokenizer`
turns each into one :class:`TokenizerSource`::

    "tok/" (a directory)  ->  TokenizerSource(json=<tokenizer.json, padding and
                              truncation off>, tokens={"eos_token": "</s>", ...},
                              configured=True, chat_template=<its Jinja text>, ...)

The JSON is normalized: padding and truncation are switched off, because
padding to the longest text of a micro-batch would make a sample's ids depend
on its neighbours, and truncation is the operators' own ``max_length``. Its
SHA-256 (:func:`tokenizer_sha256`) is the tokenizer's part of the
configuration fingerprint.

The ids of BOS and EOS (:func:`special_token_id`) come from the tokenizer's
own configuration when it has one (a transformers tokenizer's
``eos_token_id``, the ``eos_token`` of a directory's
``tokenizer_config.json``); only a tokenizer without one (a bare
``tokenizers.Tokenizer``, a ``tokenizer.json`` path) has them guessed from
token names (:data:`EOS_TOKEN_CANDIDATES`, :data:`BOS_TOKEN_CANDIDATES`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

__all__ = [
    "BOS_TOKEN_CANDIDATES",
    "EOS_TOKEN_CANDIDATES",
    "SPECIAL_TOKEN_KEYS",
    "TokenizerSource",
    "load_tokenizer",
    "special_token_id",
    "tokenizer_sha256",
]

#: Tokens tried, in order, when no ``eos_token_id`` is given.
EOS_TOKEN_CANDIDATES: tuple[str, ...] = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
#: Tokens tried, in order, when no ``bos_token_id`` is given.
BOS_TOKEN_CANDIDATES: tuple[str, ...] = ("<s>", "<bos>", "<|begin_of_text|>", "<|endoftext|>")

#: Token names a tokenizer's own configuration may define (transformers' names).
SPECIAL_TOKEN_KEYS: tuple[str, ...] = (
    "bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token",
)


@dataclass(frozen=True)
class TokenizerSource:
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
            ``tokenize_chat`` reads it
            (``zephon_torch.ops.chat_templates.default_template_of``).
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
        for key in SPECIAL_TOKEN_KEYS:
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


def load_tokenizer(tokenizer: Any) -> TokenizerSource:
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
        for key in SPECIAL_TOKEN_KEYS:
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
    return TokenizerSource(tok.to_str(), described, tokens, tokens_from, ids, configured,
                            template, template_from)


def special_token_id(tok: Tokenizer, source: TokenizerSource, which: str, explicit: Any,
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



def tokenizer_sha256(tokenizer_json: str) -> str:
    """The SHA-256 of a tokenizer's (normalized) JSON: its configuration fingerprint."""
    return hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()
