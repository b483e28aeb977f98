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
ids are placed around them according to ``special_tokens``. With
``max_length`` the body is cut so the result fits, BOS still first and EOS
still last::

    text "the lane"  ->  encode -> [412, 530]
    special_tokens="bos_eos" (bos=1, eos=0)      -> [1, 412, 530, 0]
    special_tokens="bos_eos", max_length=3       -> [1, 412, 0]
    special_tokens="none"                        -> [412, 530]

Chat samples (``tokenize_chat``) are rendered into segments, each tokenized on
its own so the ``loss_mask`` lines up exactly with the tokens: 1 on assistant
content and the EOS that ends each assistant turn, 0 elsewhere. With the
default template ``"<|{role}|>\\n{content}\\n"``::

    segment            "<|user|>\\n"  "Hi"  "\\n"  "<|assistant|>\\n"  "Hello"  EOS  "\\n"
    loss_mask               0          0     0          0              1      1    0

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
import os
from collections.abc import Callable, Mapping, Sequence
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


def _load_tokenizer_json(tokenizer: Any) -> str:
    """The tokenizer's JSON with padding and truncation switched off."""
    where = ""
    if isinstance(tokenizer, Tokenizer):
        raw = tokenizer.to_str()
    elif isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        if path.is_dir():
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
    elif isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer):
        # A transformers fast tokenizer wraps a tokenizers.Tokenizer.
        raw = tokenizer.backend_tokenizer.to_str()
    else:
        raise TypeError(
            "tokenizer must be a tokenizers.Tokenizer, a path to a tokenizer.json, or a "
            f"transformers fast tokenizer (with backend_tokenizer), got {type(tokenizer).__name__}"
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
    return tok.to_str()


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_field_name(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


class _TokenizerOperator(Operator):
    """Shared machinery: the tokenizer as JSON, its lazy rebuild, special ids."""

    #: Between the sample id and the problem in error messages.
    _separator: ClassVar[str] = " "

    def traits(self) -> OpTraits:
        """Elementwise: consecutive elementwise stages may be fused."""
        return OpTraits(elementwise=True)

    def _init_tokenizer(self, tokenizer: Any, *, special_tokens: str,
                        bos_token_id: int | None, eos_token_id: int | None,
                        on_error: str) -> None:
        _check_choice("special_tokens", special_tokens, SPECIAL_TOKEN_MODES)
        _check_choice("on_error", on_error, _ON_ERROR)
        self._tokenizer_json = _load_tokenizer_json(tokenizer)
        self.tokenizer_sha256 = hashlib.sha256(self._tokenizer_json.encode("utf-8")).hexdigest()
        self._tok: Tokenizer | None = None
        self._datasets: dict[int, Dataset] | None = None
        self.special_tokens = special_tokens
        self.on_error = on_error
        tok = self.tokenizer
        self.bos_token_id = self.eos_token_id = None
        missing = []
        for which, explicit, candidates in (("bos", bos_token_id, BOS_TOKEN_CANDIDATES),
                                            ("eos", eos_token_id, EOS_TOKEN_CANDIDATES)):
            if which not in _WANTS[special_tokens]:
                continue
            found = self._special_id(tok, tokenizer, which, explicit, candidates)
            if found is None:
                missing.append(f"no {which.upper()} token (looked for {list(candidates)}); "
                               f"pass {which}_token_id=<id>")
            setattr(self, f"{which}_token_id", found)
        if missing:
            raise ValueError(
                f"special_tokens={special_tokens!r} needs special token ids the tokenizer "
                f"does not name: {'; '.join(missing)} (or choose another special_tokens mode)"
            )

    @staticmethod
    def _special_id(tok: Tokenizer, source: Any, which: str, explicit: int | None,
                    candidates: tuple[str, ...]) -> int | None:
        arg = f"{which}_token_id"
        if explicit is not None:
            if not isinstance(explicit, (int, np.integer)) or isinstance(explicit, bool):
                raise ValueError(f"{arg} must be an int, got {explicit!r}")
            vocab = tok.get_vocab_size(with_added_tokens=True)
            if not 0 <= int(explicit) < vocab:
                raise ValueError(
                    f"{arg}={explicit} is outside the tokenizer's vocabulary [0, {vocab})"
                )
            return int(explicit)
        # A transformers tokenizer knows its own special ids: trust them first.
        known = getattr(source, arg, None) if not isinstance(source, Tokenizer) else None
        if isinstance(known, (int, np.integer)) and not isinstance(known, bool) and known >= 0:
            return int(known)
        for token in candidates:
            found = tok.token_to_id(token)
            if found is not None:
                return int(found)
        return None

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

    def _encode_apart(self, groups: list[list[str]],
                      failure: Exception) -> list[list[list[int]] | Exception]:
        """After a batched encode failed: encode each group (one sample's texts) on
        its own; a group that cannot be encoded gets its exception instead of ids.

        Whether a sample fails then depends on its texts alone, never on its
        neighbours in the micro-batch (or the micro-batch size).

        Raises:
            RuntimeError: Every group encodes on its own, so the failure was not
                in the data.
        """
        results: list[list[list[int]] | Exception] = []
        for texts in groups:
            try:
                results.append(self._encode(texts) if texts else [])
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
        tokenizer: A ``tokenizers.Tokenizer``, a path to a ``tokenizer.json``
            (or to a directory holding one), or a transformers fast tokenizer
            (anything with a ``backend_tokenizer``).
        field: Payload key holding the text.
        out_field: Payload key that receives the ids.
        special_tokens: ``"bos_eos"``, ``"eos"``, ``"bos"`` or ``"none"``.
        bos_token_id: BOS id; by default the tokenizer's (a transformers
            tokenizer's ``bos_token_id``, else the first of
            :data:`BOS_TOKEN_CANDIDATES` in the vocabulary).
        eos_token_id: EOS id, found the same way from
            :data:`EOS_TOKEN_CANDIDATES`.
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
                 special_tokens: str = "bos_eos", bos_token_id: int | None = None,
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


class TokenizeChat(_TokenizerOperator):
    """Tokenize chat conversations into ``input_ids`` and an aligned ``loss_mask``.

    Each sample's ``field`` is a list of ``{"role": str, "content": str}``
    messages. The conversation is rendered into segments; every segment is
    tokenized on its own (``add_special_tokens=False``) so that the mask can
    be exact: ``loss_mask`` is 1 on the tokens of assistant content and on
    the EOS that closes each assistant turn, 0 elsewhere (BOS, role headers,
    user/system/tool content).

    Args:
        tokenizer: As for :class:`Tokenize`.
        field: Payload key holding the messages.
        out_field: Payload key receiving the ``int32`` ids.
        mask_field: Payload key receiving the ``uint8`` mask.
        chat_template: ``None`` for :data:`DEFAULT_CHAT_TEMPLATE`; a string
            with one ``{content}`` and any number of ``{role}`` placeholders,
            rendered per message; or a callable ``messages -> [(text,
            is_assistant), ...]``. For a callable, each maximal run of
            assistant segments is one assistant turn.
        loss_on_last_turn_only: Supervise only the last assistant turn.
        roles: Accepted message roles (must include ``"assistant"``).
        special_tokens: ``"bos_eos"`` (BOS first, EOS after each assistant
            turn), ``"eos"``, ``"bos"`` or ``"none"``. Use ``"bos"`` or
            ``"none"`` when a callable template writes its own end-of-turn text.
        bos_token_id: As for :class:`Tokenize`.
        eos_token_id: As for :class:`Tokenize`.
        max_length: Cut ids and mask to this many tokens (no special-token
            repair: a cut turn simply loses its end).
        on_error: Malformed messages, or messages the tokenizer cannot
            encode: ``"raise"`` a ``ValueError`` or ``"skip"`` (tombstone with
            reason ``"tokenize_chat_error"``). The source's ``on_error`` does
            not reach this operator.
        placement: As for :class:`Tokenize`.

    Raises:
        ValueError: A bad template, mode, role list, ``max_length``, or a
            missing special token.
        TypeError: ``tokenizer`` or ``chat_template`` of the wrong kind.
    """

    name = "tokenize_chat"
    default_microbatch_size = 512
    _separator = ": "  # "tokenize_chat: sample (0, 0, 1): message 2 has role 'bot'"

    def __init__(self, tokenizer: Any, *, field: str = "messages", out_field: str = "input_ids",
                 mask_field: str = "loss_mask", chat_template: str | ChatTemplate | None = None,
                 loss_on_last_turn_only: bool = False, roles: Sequence[str] = CHAT_ROLES,
                 special_tokens: str = "bos_eos", bos_token_id: int | None = None,
                 eos_token_id: int | None = None, max_length: int | None = None,
                 on_error: str = "raise", placement: Any = "local") -> None:
        for name, value in (("field", field), ("out_field", out_field),
                            ("mask_field", mask_field)):
            _check_field_name(name, value)
        set_placement(self, placement)
        if out_field == mask_field:
            raise ValueError(f"out_field and mask_field must differ, both are {out_field!r}")
        template = DEFAULT_CHAT_TEMPLATE if chat_template is None else chat_template
        if isinstance(template, str):
            if template.count("{content}") != 1:
                raise ValueError(
                    "a string chat_template needs exactly one '{content}' placeholder (and "
                    f"optionally '{{role}}'), got {template!r}"
                )
            prefix, suffix = template.split("{content}")
            self._prefix, self._suffix = prefix, suffix
        elif not callable(template):
            raise TypeError(
                "chat_template must be None, a format string or a callable "
                f"messages -> [(text, is_assistant), ...], got {type(template).__name__}"
            )
        roles = tuple(roles)
        if "assistant" not in roles or not all(isinstance(r, str) for r in roles):
            raise ValueError(f"roles must be strings and include 'assistant', got {roles!r}")
        if max_length is not None and (not isinstance(max_length, int)
                                       or isinstance(max_length, bool) or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        self._init_tokenizer(tokenizer, special_tokens=special_tokens,
                             bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                             on_error=on_error)
        self.field = field
        self.out_field = out_field
        self.mask_field = mask_field
        self.chat_template = template
        self.loss_on_last_turn_only = bool(loss_on_last_turn_only)
        self.roles = roles
        self.max_length = max_length

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
        return None

    def _segments(self, messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool]]:
        template = self.chat_template
        if isinstance(template, str):
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

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Render, tokenize (one batched call) and mask every live record."""
        out: list[Element] = list(elems)
        jobs: list[tuple[int, list[tuple[str | int, int]]]] = []
        texts: list[str] = []
        for i, rec in enumerate(elems):
            if type(rec) is not SampleRecord:
                _check_record(rec, self.name)
            meta = rec.meta
            if meta.tags and meta.is_sentinel:
                continue
            payload = rec.payload
            if not isinstance(payload, Mapping) or self.field not in payload:
                problem = f"has no field {self.field!r}"
            else:
                problem = self._validate(payload[self.field])
            if problem is not None:
                out[i] = self._reject(rec, "tokenize_chat_error", problem)
                continue
            pieces = self._pieces(self._segments(payload[self.field]))
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
        """Parameters that define the output (a callable template by its code hash)."""
        template = self.chat_template
        return {
            **super().config(),
            "field": self.field,
            "out_field": self.out_field,
            "mask_field": self.mask_field,
            "chat_template": template if isinstance(template, str) else callable_config(template),
            "loss_on_last_turn_only": self.loss_on_last_turn_only,
            "roles": list(self.roles),
            "special_tokens": self.special_tokens,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "max_length": self.max_length,
            "on_error": self.on_error,
            "tokenizer_sha256": self.tokenizer_sha256,
        }
