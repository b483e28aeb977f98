"""A batch of records of one lane (:class:`SampleBatch`) and its ``to_training``.

Part of the data model documented in ``zephon_torch.types`` (which re-exports
the public names here). ``to_training`` itself runs the converter the package
root installs (:func:`install_training_converter`).

This module imports nothing from the package but ``vocab`` and the data model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zephon_torch._types_records import SampleRecord

if TYPE_CHECKING:
    from typing import Literal

__all__ = ["SampleBatch", "install_training_converter"]


#: What :meth:`SampleBatch.to_training` runs: ``zephon_torch._training``'s
#: ``batch_to_training``. The conversion stands above the data model (it reaches the
#: packing kernel's switch in ``ops``), so this module never imports it: the package
#: root installs it (:func:`install_training_converter`, in ``zephon_torch/__init__.py``),
#: which every import of a ``zephon_torch`` module runs first.
_training_converter: Callable[..., dict[str, Any]] | None = None


def install_training_converter(convert: Callable[..., dict[str, Any]]) -> None:
    """Make ``convert(rows, **options)`` the function behind :meth:`SampleBatch.to_training`.

    The package root calls it once, with ``zephon_torch._training.batch_to_training``.
    """
    global _training_converter
    _training_converter = convert


@dataclass(frozen=True, slots=True, eq=False)
class SampleBatch:
    """A batch of :class:`SampleRecord` of one lane, in stream order.

    ``SampleBatch(records)`` accepts any sequence and stores a tuple;
    ``lane_ids`` and ``chunk_ids`` are derived from the records. A batch has
    ``len()`` and iterates over its records.
    """

    records: tuple[SampleRecord, ...]
    lane_ids: tuple[int, ...] = field(init=False)
    chunk_ids: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        records = self.records if type(self.records) is tuple else tuple(self.records)
        object.__setattr__(self, "records", records)
        object.__setattr__(self, "lane_ids", tuple(r.meta.lane_id for r in records))
        object.__setattr__(self, "chunk_ids", tuple(r.meta.chunk_id for r in records))

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[SampleRecord]:
        return iter(self.records)

    def __getitem__(self, index: int) -> SampleRecord:
        return self.records[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleBatch):
            return NotImplemented
        return self.records == other.records

    def __hash__(self) -> int:
        return hash(self.records)

    @property
    def ids(self) -> tuple[tuple[int, int, int], ...]:
        """The ``sample_id`` of every record."""
        return tuple(r.meta.sample_id for r in self.records)

    def _training_rows(self) -> Sequence[Any]:
        """What ``to_training`` reads: the records (a block view has lighter rows)."""
        return self.records

    @property
    def lineage_paths(self) -> tuple[tuple[int, ...], ...]:
        """The ``lineage`` of every record."""
        return tuple(r.meta.lineage for r in self.records)

    def to_training(
        self,
        *,
        tokens_field: str = "auto",
        return_labels: bool = False,
        dtype: Any = "auto",
        extra_fields: Sequence[str] = (),
        ignore_index: int = -100,
        rename_fields: Mapping[str, str] | None = None,
        flatten: bool = False,
        exclude_fields: Sequence[str] = (),
        return_num_valid_tokens: bool = False,
        return_loss_mask: bool = False,
        return_cu_seqlens: bool = False,
        return_padding_mask: bool = False,
        eos_mask_loss: bool = False,
        eos_token_id: int | None = None,
        position_mode: Literal["preserve", "sequence"] = "preserve",
        return_piece_ids: bool = False,
        device: Any = None,
        pin_memory: bool = False,
        format: Literal["hf"] | None = None,
    ) -> dict[str, Any]:
        """Convert the batch to a training-ready dict, with optional LM labels.

        The common cases are one call each:

        - a transformers causal LM: pack to the model's length
          (``pack_flat(2048)``), then ``to_training(format="hf")`` and
          ``model(**batch).loss`` (``docs/huggingface.md``);
        - a loss of your own: pack one token longer (``pack_flat(2049)``),
          then ``to_training(return_labels=True)`` gives 2048 ``input_ids``
          and their next-token ``labels``.

        Without either, ``input_ids`` are the whole rows and there are no
        labels (for inference, or labels made elsewhere).

        See ``docs/to_training.md`` for the full contract with worked examples.
        In short: ``"ids"`` and ``"texts"`` are always returned as lists;
        ``"input_ids"`` stacks the token field (``tokens_field="auto"`` looks
        for ``input_ids``, ``tokens``, ``token_ids``, ``ids`` in that order; a
        payload may also be a bare 1-D array of ids). With
        ``return_labels=True``, ``input_ids = tokens[:, :-1]`` and
        ``labels = tokens[:, 1:]``, and labels are set to ``ignore_index``
        where they fall in a record's trailing padding
        (``meta.padding_length``), where a payload ``loss_mask`` (shifted by
        one, ``mask[:, 1:]``) is 0, and, with ``eos_mask_loss``, where the
        input token is ``eos_token_id``. Payload ``positions`` (from
        ``pack_flat``) are forwarded and sliced like ``input_ids``
        (``position_mode="preserve"``) or replaced by ``0..S-1`` per row
        (``"sequence"``).

        Args:
            tokens_field: Field holding the token ids, or ``"auto"``. Bare
                array payloads are the token rows themselves: the name is
                ignored for them.
            return_labels: Shift tokens into ``input_ids``/``labels``.
            dtype: ``"auto"`` (torch.long if torch imports, else numpy int64),
                ``None`` (Python lists), a torch dtype (tensors) or a numpy
                dtype (arrays). Applies to token-like integer fields.
            extra_fields: More per-token payload fields to stack; sliced like
                ``input_ids`` when labels are returned. ``positions`` may be
                listed in either ``position_mode`` and comes out once (the
                generated numbering under ``"sequence"``).
            ignore_index: Label value ignored by the loss.
            rename_fields: ``{emitted_key: new_key}``, applied before exclusion.
            flatten: Flatten sequence fields from ``[B, S]`` to ``[B * S]``
                after shifting and masking; ``cu_seqlens`` becomes one compact
                cumulative sequence and ``max_seqlen`` a Python int.
            exclude_fields: Output names (after renaming) to omit.
            return_num_valid_tokens: Add the count of labels that are not
                ``ignore_index`` (a Python int). Needs ``return_labels``.
            return_loss_mask: Add the label-aligned float32 ``loss_mask``
                (1.0 where a label counts). Needs ``return_labels``.
            return_cu_seqlens: Add ``cu_seqlens`` and ``max_seqlen`` derived
                from the zeros of the input-aligned payload positions (int32).
            return_padding_mask: Add the bool input-aligned ``padding_mask``,
                True on trailing padding only.
            eos_mask_loss: Ignore labels predicted from an EOS input token.
                Careful: if BOS and EOS share an id, the first content token
                after BOS is masked too.
            eos_token_id: Nonnegative EOS id; required by ``eos_mask_loss``.
            position_mode: ``"preserve"`` or ``"sequence"``.
            return_piece_ids: Add ``piece_ids``: for every row, a list of
                ``(dataset, shard, local, start, stop)``, one per piece it
                holds, in row order (a packed row holds several; ``ids``
                names only the first): the piece's sample id and its span
                ``row[start:stop]`` in the whole row (before the label
                shift; padding is in no piece). Off by default, and free
                when off. Packed rows need their ``positions``.
            device: Place every tensor on this device (``non_blocking`` when
                the source is pinned). Needs tensor output.
            pin_memory: Pin CPU tensors before the device copy.
            format: ``None`` (the options as given) or ``"hf"``: only what a
                transformers causal LM's ``forward`` takes, as int64 tensors:
                ``input_ids`` (the whole rows), ``labels`` (the same tokens,
                -100 on padding, where a payload ``loss_mask`` is 0, on each
                document's first token, and after EOS with
                ``eos_mask_loss``; the model shifts them itself), and
                ``position_ids`` (rows with payload positions) or
                ``attention_mask`` (rows without). ``flatten=True`` gives one
                ``[1, B * S]`` row (transformers' padding-free layout). Takes
                ``tokens_field``, ``extra_fields``, ``rename_fields``,
                ``exclude_fields``, ``flatten``, ``eos_mask_loss``,
                ``eos_token_id``, ``device`` and ``pin_memory``; other
                options are a ``ValueError``.

        Returns:
            A dict with ``ids``, ``texts``, ``input_ids`` and, as requested,
            ``labels``, ``positions``, the extra fields, ``num_valid_tokens``,
            ``loss_mask``, ``cu_seqlens``, ``max_seqlen``, ``padding_mask``,
            ``piece_ids``.

        Raises:
            TypeError: Payloads neither dicts nor arrays, or a mix of both;
                ``exclude_fields``/``extra_fields`` not a sequence of names (a
                string, None); ``ignore_index`` not an int.
            ValueError: Any inconsistent request or data (see the docs page
                for the full list); messages name the record and the field.

        Warns:
            UserWarning: ``eos_token_id`` given with ``eos_mask_loss=False``.
        """
        convert = _training_converter
        if convert is None:  # only while zephon_torch/__init__.py itself is being imported
            raise RuntimeError("SampleBatch.to_training needs the zephon_torch package "
                               "imported first (import zephon_torch)")
        return convert(
            self._training_rows(),
            tokens_field=tokens_field,
            return_labels=return_labels,
            dtype=dtype,
            extra_fields=extra_fields,
            ignore_index=ignore_index,
            rename_fields=rename_fields,
            flatten=flatten,
            exclude_fields=exclude_fields,
            return_num_valid_tokens=return_num_valid_tokens,
            return_loss_mask=return_loss_mask,
            return_cu_seqlens=return_cu_seqlens,
            return_padding_mask=return_padding_mask,
            eos_mask_loss=eos_mask_loss,
            eos_token_id=eos_token_id,
            position_mode=position_mode,
            device=device,
            pin_memory=pin_memory,
            format=format,
            return_piece_ids=return_piece_ids,
        )
