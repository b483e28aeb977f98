"""The ``tokenize`` operator: a text field to an ``int32`` array of token ids.

It is stateless: the default counting accumulator cuts the stream into
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

Where the rest lives: loading a tokenizer and its configuration in
:mod:`zephon_torch.ops.tokenizer_loading`, the machinery both tokenizing
operators share in :mod:`zephon_torch.ops.tokenizer_base`, chat samples in
:mod:`zephon_torch.ops.tokenize_chat` and their templates in
:mod:`zephon_torch.ops.chat_templates`. This module also names
:class:`TokenizeChat`, the chat constants and :func:`is_jinja_template`, where
the documentation has always shown them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.block import Block
from zephon_torch.block_columns import Ragged
from zephon_torch.ops.base import Element, live_records, live_rows
from zephon_torch.ops.chat_templates import DEFAULT_CHAT_TEMPLATE, is_jinja_template
from zephon_torch.ops.placement import set_placement
from zephon_torch.ops.tokenize_chat import CHAT_ROLES, TokenizeChat
from zephon_torch.ops.tokenizer_base import (
    SPECIAL_TOKEN_MODES,
    TokenizerOperator,
    check_field_name,
    unencodable,
)
from zephon_torch.ops.tokenizer_loading import BOS_TOKEN_CANDIDATES, EOS_TOKEN_CANDIDATES
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


def _no_text(payload: Any, field: str, text: Any) -> str:
    """What is wrong with a payload that holds no string under ``field``."""
    if isinstance(payload, Mapping) and field in payload:
        return f"field {field!r} is a {type(text).__name__}, not a str"
    if isinstance(payload, Mapping):
        return f"has no field {field!r} (fields: {sorted(map(str, payload))})"
    return f"payload is a {type(payload).__name__}, not a dict with {field!r}"


class Tokenize(TokenizerOperator):
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
        check_field_name("field", field)
        check_field_name("out_field", out_field)
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
        for i, rec in live_records(elems, self.name):
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
                                          unencodable(f"field {field!r}", text, ids), cause=ids)
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
        fields = block.fields
        if fields is not None and isinstance(fields.get(field), list):
            texts_in: list[Any] = fields[field]
            payloads = None
        else:
            payloads = block.payload_list()
            texts_in = [p.get(field) if isinstance(p, Mapping) else None for p in payloads]
        rows = live_rows(block)
        live = [i for i in rows if isinstance(texts_in[i], str)]
        bad = [i for i in rows if not isinstance(texts_in[i], str)]
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
                    unencodable(f"field {field!r}", texts_in[i], ids), cause=ids)
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
        rows = live_rows(block)
        keys = None
        same = True
        for i in rows:
            p = payloads[i]
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
        new = list(payloads)
        for i in rows:
            p = payloads[i]
            if isinstance(p, Mapping):
                new[i] = {**p, out_field: views[i]}
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
            **self._tokenizer_config(),
        }
