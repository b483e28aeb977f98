"""``to_training``'s records read as rows: tokens and per-token fields, checked.

:class:`_Gathered` takes the payloads of a batch of records (dicts holding a
token field, or 1-D token arrays), validates each row with messages that name
the record, and stacks the part of the rows a field needs (whole, input part
``[:-1]`` or label part ``[1:]``) into one ``[B, S]`` array, zero-padding
rows of different lengths. A token id the output dtype cannot hold is
refused, here for records and by :func:`_check_column_fits` for a block's
token column, never wrapped: ``2**31`` into int32 names the record and the
position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.token_ids import first_outside, id_range_error
from zephon_torch.vocab import PACKING_METADATA_TAG, find_token_field


def _preview(values: Any, limit: int = 8) -> str:
    items = list(values[:limit]) if hasattr(values, "__getitem__") else list(values)[:limit]
    text = ", ".join(str(int(v)) for v in items)
    return text + (", ..." if len(values) > limit else "")


def _as_array(value: Any) -> np.ndarray:
    if type(value) is np.ndarray:
        return value
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _is_token_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, list, tuple)) or (
        hasattr(value, "detach") and hasattr(value, "cpu")
    )


_WHOLE = slice(None)
_INPUT_PART = slice(None, -1)
_LABEL_PART = slice(1, None)


def _text_of(record: Any, payload: Any, output_name: str) -> str:
    """A payload's ``"text"``, ``""`` where it has none (no field, None, an array payload)."""
    if not isinstance(payload, dict):
        return ""
    text = payload.get("text")
    if isinstance(text, str):  # str itself, or a subclass such as numpy.str_
        return text
    if text is None:
        return ""
    # Not a text: returning it would break the promise of a list of strings, and ""
    # would claim the record has none.
    shown = repr(text)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ValueError(
        f"record {record.meta.sample_id}: its 'text' field holds a {type(text).__name__} "
        f"({shown}), not a str; to_training returns each payload's text in "
        f"{output_name!r} ('' where it has none). Store the text as a str (decode bytes "
        f"first), or leave it out of the output with exclude_fields=({output_name!r},)"
    )


def _check_token_row(record: Any, row: np.ndarray, source: str) -> np.ndarray:
    """A token row that is not 1-D integers: refused, unless it is an empty row."""
    if row.ndim != 1:
        raise ValueError(
            f"record {record.meta.sample_id}: {source} has shape {row.shape}; token rows "
            "must be 1-D sequences of ids"
        )
    if row.size:
        # Floats would be truncated and bools read as the ids 0 and 1.
        raise ValueError(
            f"record {record.meta.sample_id}: {source} holds {row.dtype} values "
            f"({_values(row)}); token ids must be integers"
        )
    return row.astype(np.int64)  # an empty list arrives as float64


def _values(row: np.ndarray, limit: int = 4) -> str:
    """The first values of a row, for messages."""
    shown = ", ".join(repr(v) for v in row[:limit].tolist())
    return f"[{shown}{', ...' if row.size > limit else ''}]"


class _Gathered:
    """Payloads of a nonempty batch: validated per-record rows, stacked on demand.

    Rows stay per record until :meth:`stack` builds the ``[B, S]`` array of the
    part that is needed (whole rows, input part or label part) in one pass,
    already in the output dtype. This is the per-record part of the work, so
    it is written as plain, tight loops.
    """

    def __init__(self, records: Sequence[Any], tokens_field: str) -> None:
        self.records = records
        self.payloads = payloads = [r.payload for r in records]
        field_name = tokens_field
        if tokens_field == "auto" and isinstance(payloads[0], dict):
            field_name = _detect_token_field(payloads[0])
        #: Where the tokens come from, for messages: a field, or the payloads themselves.
        self.token_source = (f"token field {field_name!r}" if isinstance(payloads[0], dict)
                             else "token array")
        rows = self._fast_rows(field_name)
        if rows is None:
            rows = self._checked_token_rows(field_name)
        self.tokens = rows
        self.shapes = shapes = [r.shape for r in rows]
        self.length_list = lengths = [shape[0] for shape in shapes]
        self.lengths = np.array(lengths)
        self.uniform = min(lengths) == max(lengths)

    def _fast_rows(self, name: str) -> list[np.ndarray] | None:
        """The common case in one sweep: dict payloads holding 1-D integer arrays."""
        payloads = self.payloads
        if not all(type(p) is dict for p in payloads):
            return None
        try:
            rows = [p[name] for p in payloads]
        except KeyError:
            return None
        for row in rows:
            if type(row) is not np.ndarray or row.ndim != 1 or row.dtype.kind not in "iu":
                return None
        return rows

    def _checked_token_rows(self, field_name: str) -> list[np.ndarray]:
        """Every other case, with the checks that name the offending record."""
        records, payloads = self.records, self.payloads
        dicts = isinstance(payloads[0], dict)
        rows = []
        for record, payload in zip(records, payloads):
            if isinstance(payload, dict) != dicts and (
                    isinstance(payload, dict) or _is_token_array(payload)):
                _refuse_mixed_payloads(records[0], record)
            if isinstance(payload, dict):
                row = payload.get(field_name)
                if row is None:
                    raise ValueError(
                        f"record {record.meta.sample_id} has no token field {field_name!r} "
                        f"(its fields: {sorted(payload)}); set tokens_field= to the field "
                        "holding the token ids"
                    )
            elif _is_token_array(payload):
                row = payload
            else:
                raise TypeError(
                    f"record {record.meta.sample_id} has a payload of type "
                    f"{type(payload).__name__}; to_training needs dict payloads or 1-D arrays "
                    "of token ids (tokenize first)"
                )
            if type(row) is not np.ndarray:
                row = _as_array(row)
            if row.ndim != 1 or row.dtype.kind not in "iu":
                row = _check_token_row(record, row, self.token_source)
            rows.append(row)
        return rows

    def check_fits(self, work: np.dtype) -> None:
        """Refuse a token id the output dtype cannot hold (only where it is narrower)."""
        for record, row in zip(self.records, self.tokens):
            bounds = _narrowing(row.dtype, work)
            if bounds is not None:
                where = first_outside(row, *bounds)
                if where is not None:
                    raise _fit_error(record.meta.sample_id, int(row[where]), where, bounds,
                                     work)

    def stack(self, rows: list[np.ndarray], part: slice,
              dtype: np.dtype | None = None) -> np.ndarray:
        """Stack ``row[part]`` of every row; ragged rows are zero-padded on the right."""
        parts = rows if part is _WHOLE else [row[part] for row in rows]
        if self.uniform:
            # One C-level concatenate (with the dtype cast fused in) beats np.stack,
            # whose Python-level checks cost more than the copy at these sizes.
            shape = (len(parts), *parts[0].shape)
            if dtype is None:
                return np.concatenate(parts).reshape(shape)
            return np.concatenate(parts, dtype=dtype, casting="unsafe").reshape(shape)
        out = np.zeros((len(parts), max(len(p) for p in parts), *parts[0].shape[1:]),
                       dtype=dtype or np.result_type(*parts))
        for i, values in enumerate(parts):
            out[i, : len(values)] = values
        return out

    def shifted_tokens(self, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """Fresh ``(tokens[:, :-1], tokens[:, 1:])`` arrays for inputs and labels."""
        if not self.uniform:
            return (self.stack(self.tokens, _INPUT_PART, dtype),
                    self.stack(self.tokens, _LABEL_PART, dtype))
        # Widening once and copying twice beats two widening gathers.
        tokens = self.stack(self.tokens, _WHOLE, dtype)
        return tokens[:, :-1].copy(), tokens[:, 1:].copy()

    def padding_lengths(self) -> list[int]:
        """Per-row trailing padding from ``meta.padding_length`` (0 when absent)."""
        pads = []
        for record, length in zip(self.records, self.length_list):
            tags = record.meta.tags
            info = tags.get(PACKING_METADATA_TAG) if tags else None
            pad = None if info is None else info.get("padding_length")
            if pad is None:  # no packing metadata: no padding
                pad = 0
            elif type(pad) is not int:
                pad = _integer_padding(record, pad)
            if not 0 <= pad <= length:
                raise ValueError(
                    f"record {record.meta.sample_id}: padding_length {pad} falls outside its "
                    f"token row of length {length}"
                )
            pads.append(pad)
        return pads

    def field_rows(self, name: str, *, required: bool, scalar: bool = False,
                   integer: bool = False) -> list[np.ndarray] | None:
        """The rows of a per-token field, checked aligned with the tokens.

        Returns None when no payload has the field and it is not required; a
        field present in some payloads but not all is an error. A ``scalar``
        field (positions, a loss mask) holds exactly one value per token; other
        fields may carry trailing dimensions (``[S, D]``). An ``integer`` field
        (positions) must hold integers: stacking into the integer output dtype
        would truncate floats (and ``cu_seqlens`` would follow the truncated
        zeros) and read bools as 0 and 1.
        """
        if all(type(p) is dict for p in self.payloads):
            rows = [p.get(name) for p in self.payloads]
            if [row.shape if type(row) is np.ndarray else None for row in rows] == self.shapes:
                if integer:  # aligned arrays: only their dtypes are left to check
                    self._check_integer(name, rows)
                return rows
        rows = [p.get(name) if isinstance(p, dict) else None for p in self.payloads]
        missing = [i for i, row in enumerate(rows) if row is None]
        if missing:
            if not required and len(missing) == len(rows):
                return None
            holder = self.records[missing[0]]
            how = "every payload needs it" if required else "it is in some payloads but not all"
            raise ValueError(
                f"record {holder.meta.sample_id} has no field {name!r}; {how}"
            )
        for i, (row, tokens) in enumerate(zip(rows, self.tokens)):
            if type(row) is not np.ndarray:
                rows[i] = row = _as_array(row)
            if (row.shape if scalar else row.shape[:1]) != tokens.shape:
                expected = f"({len(tokens)},)" if scalar else f"({len(tokens)}, ...)"
                what = "one value per token" if scalar else "its first dimension one per token"
                raise ValueError(
                    f"record {self.records[i].meta.sample_id}: field {name!r} has shape "
                    f"{row.shape}, misaligned with the {self.token_source} of shape "
                    f"{tokens.shape}; it must have shape {expected}, {what}"
                )
        if integer:
            self._check_integer(name, rows)
        return rows

    def _check_integer(self, name: str, rows: list[np.ndarray]) -> None:
        """Refuse rows of ``name`` that hold anything but integers (one check per row)."""
        for i, row in enumerate(rows):
            if row.dtype.kind not in "iu" and row.size:  # an empty list arrives as float64
                raise ValueError(
                    f"record {self.records[i].meta.sample_id}: field {name!r} holds "
                    f"{row.dtype} values ({_values(row)}); {name} must be integers (each "
                    "token's index in its document, as pack_flat(emit_positions=True) "
                    "writes them), never truncated here: fix what produced them, or cast "
                    "them with .astype(np.int64) if they are whole numbers"
                )


def _narrowing(source: np.dtype, work: np.dtype) -> tuple[int, int] | None:
    """The range to check when integer ids of ``source`` become ``work`` (None: all fit)."""
    if source.kind not in "iu" or work.kind not in "iu" or np.can_cast(source, work, "safe"):
        return None
    info = np.iinfo(work)
    return int(info.min), int(info.max)


def _fit_error(sample_id: Any, value: int, position: int, bounds: tuple[int, int],
               work: np.dtype) -> ValueError:
    return id_range_error(
        f"to_training: record {sample_id}", value, position, bounds[0], bounds[1],
        f"the output dtype {work} cannot hold it, and a token id is never wrapped: use "
        "dtype='auto' (int64), or a dtype that holds your vocabulary")


def _check_column_fits(columns: Mapping[str, Any], rows: Any, tokens_field: str,
                       work: np.dtype) -> None:
    """The token column of a block's batch, checked like :meth:`_Gathered.check_fits`
    (one vectorised min/max, and only where the output dtype is narrower)."""
    name = tokens_field
    if name == "auto":
        name = next((f for f in ("input_ids", "tokens", "token_ids", "ids") if f in columns),
                    None)
    tokens = columns.get(name) if name is not None else None
    if type(tokens) is not np.ndarray or tokens.ndim != 2:
        return  # the general path gathers (and checks) the rows
    bounds = _narrowing(tokens.dtype, work)
    if bounds is None:
        return
    flat = tokens.reshape(-1)
    where = first_outside(flat, *bounds)
    if where is not None:
        row, col = divmod(where, tokens.shape[1])
        raise _fit_error(rows.sample_ids[row], int(flat[where]), col, bounds, work)


def _integer_padding(record: Any, pad: Any) -> int:
    """A ``padding_length`` that is not a plain int: a numpy integer, or an error."""
    if isinstance(pad, np.integer) or (isinstance(pad, int) and not isinstance(pad, bool)):
        return int(pad)
    raise ValueError(
        f"record {record.meta.sample_id}: padding_length {pad!r} "
        f"({type(pad).__name__}) in its packing metadata "
        f"(meta.tags[{PACKING_METADATA_TAG!r}]) is not an integer; it counts the row's "
        "trailing pad tokens (pack_flat writes an int), and is never rounded here: fix "
        "what wrote it"
    )


def _refuse_mixed_payloads(first: Any, other: Any) -> None:
    def kind(payload: Any) -> str:
        return "dict" if isinstance(payload, dict) else f"{type(payload).__name__} (an array)"

    raise TypeError(
        f"payloads are neither all dicts nor all arrays: record {first.meta.sample_id} holds "
        f"a {kind(first.payload)} and record {other.meta.sample_id} a {kind(other.payload)}; "
        "to_training reads one kind per batch, so give every record a dict payload (the "
        "token ids under one field, e.g. 'input_ids') or every record a 1-D array of token ids"
    )


def _detect_token_field(payload: dict) -> str:
    return find_token_field(payload, "auto")  # type: ignore[return-value]
