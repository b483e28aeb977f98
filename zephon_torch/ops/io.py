"""Reading and decoding: the ``fetch`` and ``decode_text`` operators.

A file source emits *pointer records*: the meta names the sample
(``sample_id = (dataset_id, shard_id, local_id)``) and the payload is
:data:`~zephon_torch.sources.base.POINTER`. The two operators here turn them
into dict payloads on the workers, statelessly, one micro-batch at a time::

    SampleRecord(meta, POINTER)
      -- fetch -------->  SampleRecord(meta, b'{"text": "hi"}')   (raw bytes or dict)
      -- decode_text -->  SampleRecord(meta, {"text": "hi"})      (or a tombstone)

``fetch`` groups a micro-batch's pointers by ``(dataset, shard)`` and reads
each group with a single ``Dataset.read`` call (which sorts and windows the
reads), then puts the raw payloads back in input order. ``decode_text``
reads the dataset's ``raw_format``: ``"json"`` lines are parsed and must be
JSON objects holding a string ``field``; ``"text"`` files become
``{field: text}``; ``"dict"`` payloads (Parquet rows, items) pass through.

Nothing is dropped silently. A document whose text is empty or only
whitespace becomes a tombstone tagged ``"empty"``; a bad line (invalid
UTF-8, malformed JSON, JSON that Python refuses to load such as an integer
of more than 4,300 digits or brackets nested too deeply, not an object,
missing or non-string field, a text holding a lone UTF-16 surrogate such as
``"\\ud83d"`` that no tokenizer can encode) is a ``ValueError`` naming the
file and line, or, when the source or the operator says
``on_error="skip"``, a tombstone tagged ``"decode_error"``.

``fetch`` treats a read that fails (a corrupt Parquet row group, a file
removed since the pipeline was built) the same way: a ``ValueError`` naming
the first sample that cannot be read, or, with the source's
``on_error="skip"``, one ``"read_error"`` tombstone per sample that cannot
be read on its own. Skipped samples carry what was wrong
(:data:`~zephon_torch.ops.base.TOMBSTONE_DETAIL_TAG`) so the iterator can
report them (``stats()["bad_samples"]`` and one warning per pass).

Both operators find datasets in ``ctx.plan["datasets"]`` (dataset id ->
:class:`~zephon_torch.sources.base.Dataset`) during :meth:`setup`.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Mapping, Sequence
from operator import attrgetter, itemgetter
from typing import Any, ClassVar, Literal

import numpy as np

from zephon_torch.block import Block
from zephon_torch.block_columns import concat_columns
from zephon_torch.block_ids import ID_DATASET, ID_LOCAL, ID_SHARD
from zephon_torch.ops.base import Element, OpContext, Operator, OpTraits, live_rows, tombstone
from zephon_torch.ops.placement import set_placement
from zephon_torch.sources.base import POINTER, Dataset, is_pointer
from zephon_torch.sources.handles import DataChangedError
from zephon_torch.types import SampleRecord
from zephon_torch.vocab import is_empty_text

__all__ = ["DecodeText", "Fetch"]

OnError = Literal["raise", "skip"]

_META = attrgetter("meta")
_SAMPLE_ID = attrgetter("sample_id")
_FIRST, _SECOND, _THIRD = itemgetter(0), itemgetter(1), itemgetter(2)


def _datasets_of(ctx: OpContext, op: str) -> dict[int, Dataset]:
    datasets = ctx.plan.get("datasets") if ctx.plan else None
    if datasets is None:
        raise ValueError(f"{op}: the plan has no 'datasets' (ctx.plan['datasets'] must map "
                         "dataset ids to datasets); build the pipeline from a source such as "
                         "Pipeline.from_jsonl")
    if not isinstance(datasets, Mapping):
        raise ValueError(f"{op}: ctx.plan['datasets'] must map dataset ids to datasets, "
                         f"got {type(datasets).__name__}")
    return dict(datasets)


class _Unreadable:
    """A sample ``fetch`` could not read (skip mode): becomes a ``read_error`` tombstone."""

    __slots__ = ("detail",)

    def __init__(self, detail: str) -> None:
        self.detail = " ".join(detail.split())[:300]


class Fetch(Operator):
    """Reads the raw payloads of pointer records (``Pipeline.fetch()``).

    Records that are not pointers (already fetched, inline items, stream
    records, tombstones) pass through unchanged.

    Args:
        placement: ``"local"``, ``"remote"`` or a ``Remote(...)``: where
            ``process_many`` runs (``docs/remote-stages.md``). A remote fetch
            reads the files from the Ray workers, which must see the same
            paths (a shared file system or an fsspec URL).
    """

    name: ClassVar[str] = "fetch"
    default_microbatch_size: ClassVar[int] = 512

    def __init__(self, *, placement: Any = "local") -> None:
        set_placement(self, placement)
        self._datasets: dict[int, Dataset] | None = None

    def setup(self, ctx: OpContext) -> None:
        """Take the plan's datasets (``ctx.plan["datasets"]``)."""
        self._datasets = _datasets_of(ctx, "fetch")

    def traits(self) -> OpTraits:
        """Order-preserving, elementwise, and the one operator that accepts pointers."""
        return OpTraits(accepts_pointers=True, elementwise=True)

    def config(self) -> dict[str, Any]:
        """No parameters beyond the operator's identity."""
        return super().config()

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Replace each pointer payload with the sample's raw payload, in input order.

        Raises:
            ValueError: A pointer names a dataset the plan does not hold, or
                :meth:`setup` was not called.
        """
        out = list(elems)
        if out and all(type(e) is SampleRecord and e.payload is POINTER for e in out):
            # The common case, with no per-record Python loop: pointers of one shard.
            metas = list(map(_META, out))
            sample_ids = list(map(_SAMPLE_ID, metas))
            dataset_ids = list(map(_FIRST, sample_ids))
            shard_ids = list(map(_SECOND, sample_ids))
            dataset_id, shard_id = dataset_ids[0], shard_ids[0]
            n = len(out)
            if dataset_ids.count(dataset_id) == n and shard_ids.count(shard_id) == n:
                raws, failed = self._read(dataset_id, shard_id, list(map(_THIRD, sample_ids)))
                if not failed:
                    return list(map(SampleRecord, metas, raws))
                return [tombstone(elem, "read_error", raw.detail)
                        if isinstance(raw, _Unreadable) else SampleRecord(elem.meta, raw)
                        for elem, raw in zip(out, raws)]
        groups: dict[tuple[int, int], list[int]] = {}
        for position, elem in enumerate(out):
            if type(elem) is SampleRecord and is_pointer(elem.payload):
                dataset_id, shard_id, _ = elem.meta.sample_id
                groups.setdefault((dataset_id, shard_id), []).append(position)
        for (dataset_id, shard_id), positions in groups.items():
            local_ids = [out[p].meta.sample_id[2] for p in positions]
            raws, failed = self._read(dataset_id, shard_id, local_ids)
            for position, raw in zip(positions, raws):
                if failed and isinstance(raw, _Unreadable):
                    out[position] = tombstone(out[position], "read_error", raw.detail)
                else:
                    out[position] = SampleRecord(out[position].meta, raw)
        return out

    def process_block(self, block: Block) -> Block:
        """Read a block's pointer rows, one ``Dataset.read`` per run of one shard.

        A dataset that reads columns (Parquet: a token list column becomes one
        ragged column sliced from Arrow's offsets) gives a block of columns;
        otherwise the rows hold the raw payloads (JSONL lines as bytes).
        """
        payloads = block.payloads
        if payloads is None or not len(block):
            return block  # already columns: nothing is a pointer
        pointer = np.fromiter((p is POINTER for p in payloads), dtype=bool, count=len(block))
        if not pointer.any():
            if any(is_pointer(p) for p in payloads):
                pointer = np.fromiter((is_pointer(p) for p in payloads), dtype=bool,
                                      count=len(block))
            else:
                return block
        ids = block.ids
        keys = ids[:, ID_DATASET] * (1 << 32) + ids[:, ID_SHARD]
        if bool(pointer.all()):
            columns = self._columns_of_runs(ids, keys)
            if columns is not None:
                return block.with_fields(columns)
        out = list(payloads)
        failed_rows: list[int] = []
        details: list[str] = []
        rows = np.flatnonzero(pointer)
        cut = np.flatnonzero(keys[rows][1:] != keys[rows][:-1]) + 1
        for part in np.split(rows, cut):
            first = int(part[0])
            raws, failed = self._read(int(ids[first, ID_DATASET]), int(ids[first, ID_SHARD]),
                                      ids[part, ID_LOCAL].tolist())
            for row, raw in zip(part.tolist(), raws):
                if failed and isinstance(raw, _Unreadable):
                    failed_rows.append(row)
                    details.append(raw.detail)
                    out[row] = None
                else:
                    out[row] = raw
        result = block.with_payloads(out)
        if failed_rows:
            mask = np.zeros(len(block), dtype=bool)
            mask[failed_rows] = True
            per_row: list[str | None] = [None] * len(block)
            for row, detail in zip(failed_rows, details):
                per_row[row] = detail
            result = result.with_tombstones(mask, "read_error", per_row)
        return result

    def _columns_of_runs(self, ids: np.ndarray, keys: np.ndarray) -> dict[str, Any] | None:
        """The block's rows as columns, one ``read_columns`` per run of one shard (None if
        a run's dataset does not read columns, or the runs' columns differ in layout)."""
        cut = np.flatnonzero(keys[1:] != keys[:-1]) + 1
        runs = []
        for start, stop in zip([0, *cut.tolist()], [*cut.tolist(), len(keys)]):
            columns = self._read_columns(int(ids[start, ID_DATASET]),
                                         int(ids[start, ID_SHARD]), ids[start:stop, ID_LOCAL])
            if columns is None or (runs and list(columns) != list(runs[0])):
                return None
            runs.append(columns)
        return concat_columns(runs)

    def _read_columns(self, dataset_id: int, shard_id: int,
                      local_ids: np.ndarray) -> dict[str, Any] | None:
        """A shard's rows as columns, when its dataset reads so and nothing fails."""
        dataset = self._dataset(dataset_id)
        read_columns = getattr(dataset, "read_columns", None)
        if read_columns is None:
            return None
        try:
            return read_columns(shard_id, local_ids)
        except Exception:  # a damaged file: the row path names it, or skips what fails
            return None

    def _read(self, dataset_id: int, shard_id: int,
              local_ids: list[int]) -> tuple[list[Any], bool]:
        """The raw payloads of ``local_ids``, and whether the group read failed (then
        the samples that cannot be read on their own are :class:`_Unreadable`)."""
        dataset = self._dataset(dataset_id)
        failed = False
        try:
            raws = dataset.read(shard_id, local_ids)
        except DataChangedError:
            raise  # a stale view of a rewritten file: never a skipped sample
        except Exception as exc:  # a damaged file: name it, or skip what cannot be read
            raws, failed = self._read_failed(dataset, shard_id, local_ids, exc), True
        if len(raws) != len(local_ids):
            raise RuntimeError(f"fetch: dataset {dataset.name!r} returned {len(raws)} "
                               f"payloads for {len(local_ids)} ids of shard {shard_id}")
        return raws, failed

    @staticmethod
    def _read_failed(dataset: Dataset, shard_id: int, local_ids: list[int],
                     exc: Exception) -> list[Any]:
        """After a failed group read: raise naming the place, or (skip) read one id at a
        time and mark the ids that still fail. Either way the outcome depends only on
        the data, so every runner and every resume decides the same."""
        if dataset.on_error != "skip":
            # Name the first sample that cannot be read on its own (the error path only).
            where, cause = None, exc
            for local_id in sorted(local_ids):
                try:
                    dataset.read(shard_id, [local_id])
                except Exception as one:
                    where, cause = dataset.locate(shard_id, local_id), one
                    break
            if where is None:  # each reads alone: name the whole group
                first, last = min(local_ids), max(local_ids)
                where = dataset.locate(shard_id, first)
                if first != last:
                    where += f" (through {dataset.locate(shard_id, last)})"
            raise ValueError(
                f"fetch: cannot read {where} of dataset {dataset.name!r}: "
                f"{type(cause).__name__}: {cause}; the file may be truncated or corrupt: "
                "re-create it, or pass on_error='skip' to the source to turn the samples "
                "that cannot be read into counted tombstones"
            ) from cause
        raws: list[Any] = []
        for local_id in local_ids:
            # Two more tries each, so that a passing storage hiccup does not decide
            # what is skipped (the skip must depend on the data only).
            for attempt in range(2):
                try:
                    raws.extend(dataset.read(shard_id, [local_id]))
                    break
                except Exception as one:
                    if attempt == 1:
                        raws.append(_Unreadable(f"{type(one).__name__}: {one}"))
        return raws

    def _dataset(self, dataset_id: int) -> Dataset:
        if self._datasets is None:
            raise ValueError("fetch: setup(ctx) was not called, so no dataset is known; "
                             "the runner calls it with ctx.plan['datasets']")
        dataset = self._datasets.get(dataset_id)
        if dataset is None:
            raise ValueError(f"fetch: no dataset with id {dataset_id} in the plan (known: "
                             f"{sorted(self._datasets)})")
        return dataset


class _DecodeError(Exception):
    """One bad sample (message without the location, added by the caller)."""


class DecodeText(Operator):
    """Turns raw payloads into dict payloads (``Pipeline.decode_text(field=...)``).

    Args:
        field: The key holding the document's text. JSON lines must hold a
            string under it (or, for chat data, a list such as ``messages``);
            text files are decoded to ``{field: text}`` (a text dataset's own
            ``field`` is used while this stays ``"text"``).
        on_error: ``"skip"`` turns bad samples into ``"decode_error"``
            tombstones whatever the dataset says; ``"raise"`` (the default)
            defers to the dataset's ``on_error``. (The tokenizing operators
            take their own ``on_error``; the dataset's does not reach them.)
        placement: ``"local"``, ``"remote"`` or a ``Remote(...)`` (see
            :class:`Fetch`).

    Raises:
        ValueError: ``field`` is not a non-empty string or ``on_error`` is not
            ``"raise"``/``"skip"``.
    """

    name: ClassVar[str] = "decode_text"
    default_microbatch_size: ClassVar[int] = 512

    def __init__(self, field: str = "text", on_error: OnError = "raise", *,
                 placement: Any = "local") -> None:
        if not isinstance(field, str) or not field:
            raise ValueError(f"decode_text: field must be a non-empty string such as 'text', "
                             f"got {field!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"decode_text: on_error must be 'raise' or 'skip', "
                             f"got {on_error!r}")
        set_placement(self, placement)
        self.field = field
        self.on_error: OnError = on_error
        self._datasets: dict[int, Dataset] | None = None

    def setup(self, ctx: OpContext) -> None:
        """Take the plan's datasets (``ctx.plan["datasets"]``)."""
        self._datasets = _datasets_of(ctx, "decode_text")

    def traits(self) -> OpTraits:
        """Elementwise: consecutive elementwise stages may be fused."""
        return OpTraits(elementwise=True)

    def config(self) -> dict[str, Any]:
        """``field`` and ``on_error``."""
        return {**super().config(), "field": self.field, "on_error": self.on_error}

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Decode each record's raw payload; see the module doc for the rules.

        Raises:
            ValueError: A pointer record (``fetch()`` must come first), or a bad
                sample whose source has ``on_error="raise"``.
        """
        return [self._decode(elem) if type(elem) is SampleRecord else elem for elem in elems]

    def _decode(self, record: SampleRecord) -> SampleRecord:
        meta = record.meta
        if meta.is_sentinel:
            return record
        kind, value = self._outcome(meta.sample_id, record.payload)
        if kind == "same":
            return record
        if kind == "value":
            return SampleRecord(meta, value)
        if kind == "empty":
            return tombstone(record, "empty")
        return tombstone(record, "decode_error", value)

    def _outcome(self, sample_id: tuple[int, int, int], payload: Any) -> tuple[str, Any]:
        """What decoding one payload gives: ``("same", None)`` (unchanged),
        ``("value", payload)``, ``("empty", None)`` or ``("bad", detail)`` (skipped).

        Raises:
            ValueError: A pointer, or a bad sample that is not to be skipped.
        """
        if is_pointer(payload):
            raise ValueError(f"decode_text received the unfetched pointer {sample_id}; "
                             "add .fetch() before .decode_text()")
        dataset = self._lookup(sample_id[0])
        field = self.field
        try:
            if isinstance(payload, dict):
                text = payload.get(field)
                if isinstance(text, str) and is_empty_text(text):
                    return "empty", None
                return "same", None
            if isinstance(payload, (bytes, bytearray, memoryview, str)):
                raw_format = "json" if dataset is None else dataset.raw_format
                if raw_format == "text":
                    if field == "text":
                        field = getattr(dataset, "field", field)
                    value = {field: _as_text(payload)}
                elif raw_format == "json":
                    value = self._parse_json(payload)
                else:
                    raise _DecodeError(f"got {type(payload).__name__} from a dataset whose "
                                       f"raw_format is {raw_format!r}")
                text = value[field]
                if is_empty_text(text):
                    return "empty", None
                if raw_format == "text" and isinstance(payload, str) and not text.isascii():
                    # Strict UTF-8 decoding cannot yield a surrogate; a str can.
                    _check_unicode(text, field)
                return "value", value
            return "same", None  # token arrays and other payloads are already decoded
        except _DecodeError as exc:
            if self.on_error == "skip" or (dataset is not None and dataset.on_error == "skip"):
                return "bad", str(exc)[:300]
            where = (f"{dataset.locate(sample_id[1], sample_id[2])}"
                     if dataset is not None else "the input")
            where += _last_line_hint(dataset, sample_id, payload)
            raise ValueError(f"decode_text: {exc} at {where} (sample {sample_id}); fix "
                             "the data, or pass on_error='skip' to the source or to "
                             "decode_text() to turn such samples into counted tombstones"
                             ) from exc.__cause__

    def process_block(self, block: Block) -> Block:
        """:meth:`process_many` for a block: the same decisions, row by row over its payloads."""
        n = len(block)
        if block.fields is not None:  # dict payloads held as columns (Parquet rows)
            texts = block.fields.get(self.field)
            if not isinstance(texts, list):
                return block
            empty = np.fromiter((isinstance(t, str) and is_empty_text(t) for t in texts),
                                dtype=bool, count=n)
            return block.with_tombstones(empty, "empty") if empty.any() else block
        payloads = block.payloads
        assert payloads is not None
        sample_ids = block.ids[:, :3].tolist()
        out = list(payloads)
        reasons: list[str | None] = [None] * n
        details: list[str | None] = [None] * n
        changed = False
        for i in live_rows(block):
            payload = payloads[i]
            kind, value = self._outcome(tuple(sample_ids[i]), payload)
            if kind == "value":
                out[i] = value
                changed = True
            elif kind == "empty":
                reasons[i] = "empty"
            elif kind == "bad":
                reasons[i], details[i] = "decode_error", value
        result = block.with_payloads(out) if changed else block
        mask = np.fromiter((r is not None for r in reasons), dtype=bool, count=n)
        if mask.any():
            result = result.with_tombstones(mask, reasons, details)
        return result

    def _parse_json(self, payload: bytes | bytearray | memoryview | str) -> dict[str, Any]:
        value = _loads(_as_text(payload))
        if not isinstance(value, dict):
            raise _DecodeError(f"the JSON line is a {type(value).__name__}, not an object")
        if self.field not in value:
            keys = ", ".join(map(repr, list(value)[:8])) or "none"
            raise _DecodeError(f"the JSON object has no {self.field!r} field (keys: {keys}); "
                               "pass decode_text(field=...) to read another key")
        # A string, or structured content such as chat ``messages`` (a list of turns).
        if not isinstance(value[self.field], (str, list, dict)):
            raise _DecodeError(f"field {self.field!r} is a "
                               f"{type(value[self.field]).__name__}, not a string (or a list "
                               "of chat messages)")
        text = value[self.field]
        if not (type(text) is str and text.isascii()):  # an ASCII text cannot hold one
            _check_unicode(text, self.field)
        return value

    def _lookup(self, dataset_id: int) -> Dataset | None:
        # Without a plan (a standalone op, dict payloads only) there is no dataset.
        if self._datasets is None:
            return None
        return self._datasets.get(dataset_id)


def _last_line_hint(dataset: Dataset | None, sample_id: tuple[int, int, int],
                    payload: Any) -> str:
    """A hint when the bad sample is the unterminated last line of a JSON Lines file."""
    if dataset is None or dataset.raw_format != "json":
        return ""
    _, shard_id, local_id = sample_id
    try:
        shard = dataset.shards()[shard_id]
        path = shard.path
        if local_id != shard.num_samples - 1 or path is None or "://" in path:
            return ""
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            if fh.tell() == 0:
                return ""
            fh.seek(-1, 2)
            ends_with_newline = fh.read(1) in (b"\n", b"\r")  # "\r": an old Mac file
    except (OSError, IndexError):
        return ""
    if ends_with_newline or path.endswith((".gz", ".zst")):
        return ""
    return (", the file's last line, which has no line ending: the file looks truncated "
            "(cut off while it was written or copied)")


def _loads(text: str) -> Any:
    """``json.loads`` of one line; what Python cannot load becomes a :class:`_DecodeError`."""
    try:
        return json.loads(text)
    except RecursionError:
        pass  # retried below, once this stack has unwound
    except ValueError as exc:  # JSONDecodeError, or valid JSON Python refuses
        raise _json_failure(exc) from exc
    # How deep the caller's stack happens to be must not decide whether a
    # deeply nested line loads (runners call from different depths): parse it
    # again at the bottom of a fresh thread's stack, so the outcome depends on
    # the line alone.
    return _loads_on_a_fresh_stack(text)


def _loads_on_a_fresh_stack(text: str) -> Any:
    """``json.loads`` in a new thread (whose stack starts empty), for deep nesting."""
    outcome: list[Any] = []

    def attempt() -> None:
        try:
            outcome.append(json.loads(text))
        except (ValueError, RecursionError) as exc:
            outcome.append(exc)

    worker = threading.Thread(target=attempt, name="zephon-decode-deep-json", daemon=True)
    worker.start()
    worker.join()
    result = outcome[0] if outcome else RuntimeError("the parsing thread stopped early")
    if isinstance(result, BaseException):
        raise _json_failure(result) from result
    return result


def _json_failure(exc: BaseException) -> _DecodeError:
    """What to say about a line ``json.loads`` could not load."""
    if isinstance(exc, json.JSONDecodeError):
        return _DecodeError(f"malformed JSON ({exc})")
    if isinstance(exc, RecursionError):
        return _DecodeError(
            "JSON nested too deeply for Python to load (it stops near "
            f"{sys.getrecursionlimit()} levels of brackets: {exc})")
    # Valid JSON that Python refuses, such as an integer of more than 4,300 digits.
    return _DecodeError(f"JSON that Python refuses to load ({type(exc).__name__}: {exc})")


_NOT_UNICODE = ("not valid Unicode, so no tokenizer can encode it; often half of an emoji cut "
                "by a scraper")


def _check_unicode(text: Any, field: str) -> None:
    """Reject a lone UTF-16 surrogate in the text (or in chat message contents).

    JSON may spell one (``"\\ud83d"``, half of an emoji cut by a scraper), and
    ``json.loads`` returns it, but it is not Unicode text: no tokenizer can
    encode it, and it would fail far from its file and line.
    """
    if isinstance(text, str):
        where = _lone_surrogate(text)
        if where is not None:
            raise _DecodeError(f"a lone UTF-16 surrogate {where} in field {field!r} "
                               f"({_NOT_UNICODE})")
    elif isinstance(text, list):
        for k, message in enumerate(text):
            content = message.get("content") if isinstance(message, dict) else None
            where = _lone_surrogate(content) if isinstance(content, str) else None
            if where is not None:
                raise _DecodeError(f"a lone UTF-16 surrogate {where} in the content of message "
                                   f"{k} of field {field!r} ({_NOT_UNICODE})")


def _lone_surrogate(text: str) -> str | None:
    """``"\\ud83d (character 6)"`` for the first lone surrogate of ``text``, else ``None``."""
    if text.isascii():  # the common case, without a copy
        return None
    try:
        text.encode("utf-8")  # fails on a surrogate, and on nothing else
    except UnicodeEncodeError as exc:
        return f"\\u{ord(text[exc.start]):04x} (character {exc.start})"
    return None


def _as_text(payload: bytes | bytearray | memoryview | str) -> str:
    if isinstance(payload, str):
        return payload
    try:
        text = bytes(payload).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _DecodeError(f"invalid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    return text[1:] if text.startswith("\ufeff") else text  # a byte-order mark is no text
