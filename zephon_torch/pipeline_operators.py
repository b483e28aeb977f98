"""The builders of the built-in operators: ``Pipeline.fetch`` ... ``Pipeline.batch``.

Each appends one operator (with :meth:`~zephon_torch.pipeline.Pipeline.apply`)
and is bound into :class:`~zephon_torch.pipeline.Pipeline`'s body, so it reads
``Pipeline.pack_flat(...)`` in ``help()``, in error messages and in the API
reference (``zephon_torch/_builder.py``).

Each builder spells out its operator's parameters, so that an IDE and
``help()`` show them, and takes their defaults from the operator's
``__init__`` (the namespaces made by ``defaults_of`` below), so the two cannot
disagree; ``tests/test_api_reference.py`` checks the names, order, kinds and
annotations. The arguments reach the operator in one way for every builder:
:func:`_append` passes each of the operator's parameters by name, from the
builder's own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zephon_torch._builder import defaults_of, pipeline_method
from zephon_torch.ops.base import Operator
from zephon_torch.ops.batch import Batch
from zephon_torch.ops.chat_templates import ChatTemplate
from zephon_torch.ops.io import DecodeText, Fetch, OnError
from zephon_torch.ops.mixture import EnsureMixture, WeightBy
from zephon_torch.ops.packing import PackFlat, PackSequences
from zephon_torch.ops.shuffle import Shuffle
from zephon_torch.ops.tokenize import Tokenize
from zephon_torch.ops.tokenize_chat import TokenizeChat
from zephon_torch.ops.transform import Filter, MapTransform

if TYPE_CHECKING:
    from zephon_torch.pipeline import Pipeline

__all__: list[str] = []

_FETCH = defaults_of(Fetch)
_DECODE_TEXT = defaults_of(DecodeText)
_TOKENIZE = defaults_of(Tokenize)
_TOKENIZE_CHAT = defaults_of(TokenizeChat)
_MAP_TRANSFORM = defaults_of(MapTransform)
_PACK_SEQUENCES = defaults_of(PackSequences)
_PACK_FLAT = defaults_of(PackFlat)
_ENSURE_MIXTURE = defaults_of(EnsureMixture)
_SHUFFLE = defaults_of(Shuffle)
_BATCH = defaults_of(Batch)


def _append(pipe: Pipeline, op_type: Callable[..., Operator],
            arguments: Mapping[str, Any]) -> Pipeline:
    """``pipe`` with an ``op_type`` appended, made of a builder's ``arguments`` (its
    ``locals()``): each parameter of the operator passed by name."""
    names = inspect.signature(op_type).parameters
    return pipe.apply(op_type(**{name: arguments[name] for name in names}))


@pipeline_method
def fetch(self, *, placement: Any = _FETCH.placement) -> Pipeline:
    """Read the bytes of pointer records (on the workers).

    File sources emit pointers (the bytes are still on disk); ``fetch``
    reads them where the stage runs, so reading scales with the workers.

    Args:
        placement: ``"local"`` (the pipeline's runner), ``"remote"`` or a
            ``Remote(...)`` (Ray actors; ``docs/remote-stages.md``).

    Returns:
        A new pipeline.
    """
    return _append(self, Fetch, locals())

@pipeline_method
def decode_text(self, field: str = _DECODE_TEXT.field, *,
                on_error: OnError = _DECODE_TEXT.on_error,
                placement: Any = _DECODE_TEXT.placement) -> Pipeline:
    """Turn raw bytes into dict payloads (JSON rows, or ``{field: text}``).

    Args:
        field: The key holding the document's text. JSON lines must hold
            a string under it (or, for chat data, a list such as
            ``messages``); text files are decoded to ``{field: text}``.
        on_error: ``"skip"`` turns bad samples (invalid JSON or UTF-8, a
            missing field) into ``"decode_error"`` tombstones;
            ``"raise"`` defers to the source's ``on_error``.
        placement: As for :meth:`fetch`.

    Returns:
        A new pipeline.
    """
    return _append(self, DecodeText, locals())

@pipeline_method
def tokenize(
    self,
    tokenizer: Any,
    *,
    field: str = _TOKENIZE.field,
    out_field: str = _TOKENIZE.out_field,
    special_tokens: str = _TOKENIZE.special_tokens,
    bos_token_id: int | None = _TOKENIZE.bos_token_id,
    eos_token_id: int | None = _TOKENIZE.eos_token_id,
    max_length: int | None = _TOKENIZE.max_length,
    on_error: str = _TOKENIZE.on_error,
    placement: Any = _TOKENIZE.placement,
) -> Pipeline:
    """Encode a text field into an ``int32`` array of token ids.

    Texts are encoded without the tokenizer's own special tokens; the
    operator places BOS/EOS around each document as ``special_tokens``
    says, so that packing sees document boundaries.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``, the path of a
            ``tokenizer.json`` (or of a folder holding one), or a
            ``transformers`` fast tokenizer.
        field: Payload key holding the text.
        out_field: Payload key that receives the ids.
        special_tokens: Which special tokens frame each document:
            ``"eos"`` (the default: one EOS after each document, so packed
            documents are separated by one token), ``"bos_eos"``,
            ``"bos"`` or ``"none"``.
        bos_token_id: BOS id; by default the tokenizer's own (from
            ``tokenizer_config.json`` of a tokenizer directory, or a
            transformers tokenizer's ``bos_token_id``).
        eos_token_id: EOS id; by default the tokenizer's own (found the
            same way).
        max_length: Keep at most this many ids, special tokens included
            (BOS stays first, EOS last); ``None``: no limit.
        on_error: A payload without a string ``field``, or a text the
            tokenizer cannot encode: ``"raise"`` a ``ValueError`` naming
            the sample's file and line, or ``"skip"`` it (a tombstone).
        placement: ``"local"``, ``"remote"`` or a ``Remote(...)``: where
            the stage runs (``docs/remote-stages.md``).

    Returns:
        A new pipeline.

    Raises:
        ValueError: An unknown mode, a special token the tokenizer does
            not have (pass its id), or a bad ``max_length``.
        TypeError: ``tokenizer`` is none of the accepted kinds.
        FileNotFoundError: ``tokenizer`` is a path that does not exist.
    """
    return _append(self, Tokenize, locals())

@pipeline_method
def tokenize_chat(
    self,
    tokenizer: Any,
    *,
    field: str = _TOKENIZE_CHAT.field,
    out_field: str = _TOKENIZE_CHAT.out_field,
    mask_field: str = _TOKENIZE_CHAT.mask_field,
    chat_template: str | ChatTemplate | None = _TOKENIZE_CHAT.chat_template,
    loss_on_last_turn_only: bool = _TOKENIZE_CHAT.loss_on_last_turn_only,
    roles: Sequence[str] = _TOKENIZE_CHAT.roles,
    special_tokens: str | None = _TOKENIZE_CHAT.special_tokens,
    bos_token_id: int | None = _TOKENIZE_CHAT.bos_token_id,
    eos_token_id: int | None = _TOKENIZE_CHAT.eos_token_id,
    max_length: int | None = _TOKENIZE_CHAT.max_length,
    chat_template_kwargs: Mapping[str, Any] | None = _TOKENIZE_CHAT.chat_template_kwargs,
    on_error: str = _TOKENIZE_CHAT.on_error,
    placement: Any = _TOKENIZE_CHAT.placement,
) -> Pipeline:
    """Chat conversations to ``input_ids`` and an assistant-only ``loss_mask``.

    Each sample's ``field`` is a list of ``{"role": ..., "content": ...}``
    messages; the ``uint8`` mask is 1 on what the assistant writes (its
    content and the end of each of its turns) and 0 elsewhere. How the
    text is tokenized depends on the template. A Jinja template (the
    model's own, or a string holding ``{%``/``{{``) is rendered as
    transformers' ``apply_chat_template`` renders it and tokenized as
    one text, so the ids are what the model sees at inference; the mask
    marks the tokens that cover an assistant span. A format string or a
    callable is rendered into segments, each tokenized on its own, so
    the mask lines up with the tokens by construction, with the EOS the
    operator adds after each assistant turn supervised.

    Args:
        tokenizer: As for :meth:`tokenize`.
        field: Payload key holding the messages.
        out_field: Payload key receiving the ``int32`` ids.
        mask_field: Payload key receiving the ``uint8`` mask.
        chat_template: How a conversation is rendered: ``None`` for the
            tokenizer's own Jinja template (``chat_template.jinja`` or
            ``tokenizer_config.json`` of a tokenizer directory, a
            transformers tokenizer's ``chat_template``), else the built-in
            per-turn format ``"<|{role}|>\\n{content}\\n"``; a Jinja
            string (holding ``{%`` or ``{{``); a format string with one
            ``{content}`` and any ``{role}`` placeholders; or a callable
            ``messages -> [(text, is_assistant), ...]``.
        loss_on_last_turn_only: Supervise only the last assistant turn.
        roles: Accepted message roles (must include ``"assistant"``).
        special_tokens: ``None``: ``"none"`` with a Jinja template (which
            writes the model's own special tokens), ``"bos_eos"`` otherwise
            (BOS first, EOS after each assistant turn). Or ``"eos"``,
            ``"bos"``, ``"none"``.
        bos_token_id: As for :meth:`tokenize`.
        eos_token_id: As for :meth:`tokenize`.
        max_length: Cut ids and mask to this many tokens; ``None``: no
            limit.
        chat_template_kwargs: Extra variables for a Jinja template (JSON
            values), like the keyword arguments of transformers'
            ``apply_chat_template`` (``{"enable_thinking": False}``).
        on_error: Malformed messages or text the tokenizer cannot encode:
            ``"raise"`` a ``ValueError`` or ``"skip"`` (a tombstone).
        placement: As for :meth:`tokenize`.

    Returns:
        A new pipeline.

    Raises:
        ValueError: A bad template, mode, role list or ``max_length``, or
            a special token the tokenizer does not have.
        TypeError: ``tokenizer`` or ``chat_template`` of the wrong kind.
    """
    return _append(self, TokenizeChat, locals())

@pipeline_method
def map_transform(self, fn: Callable[[Any], Any], *,
                  drop_none: bool = _MAP_TRANSFORM.drop_none,
                  placement: Any = _MAP_TRANSFORM.placement) -> Pipeline:
    """Apply ``fn(payload) -> payload`` to every sample, keeping its identity.

    Args:
        fn: The function. It must be deterministic (it may run in any
            worker, and again after a resume); returning its input
            unchanged reuses the record as it is.
        drop_none: ``True``: a ``None`` result drops the sample (a
            counted tombstone, reason ``"map_none"``); ``False``: ``None``
            is kept as the payload.
        placement: As for :meth:`tokenize`.

    Returns:
        A new pipeline.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    return _append(self, MapTransform, locals())

@pipeline_method
def filter(self, predicate: Callable[[Any], Any]) -> Pipeline:
    """Keep the samples whose payload passes ``predicate``.

    Args:
        predicate: ``predicate(payload) -> bool``; a sample for which it
            is falsy becomes a counted tombstone (reason ``"filter"``).

    Returns:
        A new pipeline.

    Raises:
        TypeError: ``predicate`` is not callable.
    """
    return _append(self, Filter, locals())

@pipeline_method
def pack_sequences(
    self,
    max_length: int,
    *,
    num_bins: int = _PACK_SEQUENCES.num_bins,
    algorithm: str = _PACK_SEQUENCES.algorithm,
    tokens_field: str = _PACK_SEQUENCES.tokens_field,
    min_sequence_length: int = _PACK_SEQUENCES.min_sequence_length,
    oversized: str = _PACK_SEQUENCES.oversized,
    bfd_window: int | None = _PACK_SEQUENCES.bfd_window,
) -> Pipeline:
    """Pack documents into bins of at most ``max_length`` tokens, kept apart.

    Each output payload is ``{"packed_samples": [segment payloads...]}``:
    whole documents as they were, pieces of a split document as copies
    cut to the piece. Nothing is padded.

    Args:
        max_length: Most tokens per bin.
        num_bins: Bins that may be open per lane (ignored by ``"wrap"``
            and ``"best_fit_decreasing"``).
        algorithm: ``"first_fit"``, ``"best_fit"``, ``"wrap"``
            (documents cut at bin boundaries) or ``"best_fit_decreasing"``
            (over windows of ``bfd_window`` documents).
        tokens_field: Payload field holding the token ids, or ``"auto"``
            (``input_ids``, ``tokens``, ``token_ids``, ``ids``, in that
            order).
        min_sequence_length: A bin whose room drops below this is
            emitted.
        oversized: What happens to a document longer than ``max_length``:
            ``"split"`` into pieces, ``"drop"`` (a tombstone) or
            ``"truncate"``.
        bfd_window: Documents per ``"best_fit_decreasing"`` window
            (``None``: 4096); only for that algorithm.

    Returns:
        A new pipeline.

    Raises:
        ValueError: A parameter out of range or an unknown mode.
    """
    return _append(self, PackSequences, locals())

@pipeline_method
def pack_flat(
    self,
    max_length: int,
    *,
    num_bins: int = _PACK_FLAT.num_bins,
    algorithm: str = _PACK_FLAT.algorithm,
    tokens_field: str = _PACK_FLAT.tokens_field,
    pad_token_id: int = _PACK_FLAT.pad_token_id,
    emit_positions: bool = _PACK_FLAT.emit_positions,
    min_sequence_length: int = _PACK_FLAT.min_sequence_length,
    oversized: str = _PACK_FLAT.oversized,
    bfd_window: int | None = _PACK_FLAT.bfd_window,
) -> Pipeline:
    """Pack documents into flat rows of exactly ``max_length`` tokens.

    Each row is ``{"input_ids": int32[max_length]}`` plus ``positions``
    (restarting at 0 for every document) and ``loss_mask`` when the
    documents carry one; the trailing padding length is in the record's
    metadata, which ``to_training`` reads.

    Args:
        max_length: Row length: the model's sequence length + 1, since
            labels shift by one.
        num_bins: Bins that may be open per lane (ignored by ``"wrap"``
            and ``"best_fit_decreasing"``).
        algorithm: ``"first_fit"``, ``"best_fit"``, ``"wrap"``
            (concatenate and cut: no padding) or ``"best_fit_decreasing"``
            (over windows of ``bfd_window`` documents).
        tokens_field: As for :meth:`pack_sequences`.
        pad_token_id: Token id written into the trailing padding.
        emit_positions: Emit the per-document ``positions`` field.
        min_sequence_length: A bin whose room drops below this is
            emitted.
        oversized: As for :meth:`pack_sequences`.
        bfd_window: As for :meth:`pack_sequences`.

    Returns:
        A new pipeline.

    Raises:
        ValueError: A parameter out of range or an unknown mode.
    """
    return _append(self, PackFlat, locals())

@pipeline_method
def ensure_mixture(
    self,
    *,
    weight_by: WeightBy = _ENSURE_MIXTURE.weight_by,
    max_buffer_size: int = _ENSURE_MIXTURE.max_buffer_size,
    mixture: Mapping[int, float] | None = _ENSURE_MIXTURE.mixture,
) -> Pipeline:
    """Reorder each lane so its component shares track the target mixture.

    A per-lane smooth weighted round-robin over the components, toward
    ``mixture`` or the source weights: it corrects what filtering and
    packing did to the shares.

    Args:
        weight_by: What a share counts: ``"auto"`` (tokens when the
            records carry token ids, else samples), ``"samples"``,
            ``"tokens"``, a payload field name, or ``fn(record) ->
            float``.
        max_buffer_size: Most records a lane holds while waiting for a
            missing component; beyond it records leave from what is there.
        mixture: Component id -> weight; ``None`` uses the sources'
            weights (equal weights when there are none).

    Returns:
        A new pipeline.

    Raises:
        ValueError: A bad ``max_buffer_size``, weight or ``weight_by``.
    """
    return _append(self, EnsureMixture, locals())

@pipeline_method
def shuffle(self, buffer_size: int = _SHUFFLE.buffer_size, *, seed: int = _SHUFFLE.seed,
            algorithm: str = _SHUFFLE.algorithm) -> Pipeline:
    """Shuffle each lane's records, with an order derived from the data and ``seed``.

    The order is a function of the records' cursor keys and the seed, so
    it is the same on every runner and worker count and after a resume.

    Args:
        buffer_size: Records the shuffle holds, over all lanes: each lane
            shuffles its own records in a share of ``ceil(buffer_size /
            num_lanes)`` (the source's ``num_lanes``, so the share is the
            same on any world size and worker count), the reservoir of
            ``"streaming"`` or the block of ``"block"`` and
            ``"block_warmup"``. The first records come out once a lane's
            share is full, after about ``buffer_size`` were read. Larger
            mixes further and holds more in memory; it defines the
            output. It must exceed ``num_lanes`` (one record a lane does
            not shuffle). This meaning is new: ``buffer_size`` was each
            lane's size, so pipelines that shuffle give another order
            than before; ``buffer_size * num_lanes`` gives the old one
            and resumes a state saved before, which any other size
            refuses (``docs/migration.md``).
        seed: The shuffle's own seed (the pipeline's seed does not enter
            it); another seed gives another order.
        algorithm: ``"streaming"`` (a reservoir per lane: once full,
            each arrival takes the place of a held record, which leaves),
            ``"block"`` (each block of a lane's share in a shuffled
            order) or ``"block_warmup"`` (as ``"block"``, with blocks
            doubling from ``min(64, share // 16)`` up to the share, so
            the first batches come sooner).

    Returns:
        A new pipeline.

    Raises:
        ValueError: ``buffer_size`` is not a positive integer or is at
            most ``num_lanes``, ``seed`` is not an integer, or
            ``algorithm`` is unknown. (``iter()`` checks ``num_lanes``
            again, for a source changed later by ``with_source`` or a
            ``Shuffle`` given to ``apply``.)
    """
    op = Shuffle(buffer_size, seed=seed, algorithm=algorithm)
    op.lane_buffer_size(self.source.num_lanes)  # at once, as other parameters are checked
    return self.apply(op)

@pipeline_method
def batch(self, microbatch_size: int, *,
          drop_last: bool = _BATCH.drop_last) -> Pipeline:
    """Group each lane's records into batches (:class:`~zephon_torch.SampleBatch`).

    Args:
        microbatch_size: Records (rows) per batch, as handed to the
            trainer.
        drop_last: Drop (as counted tombstones) the partial batch a lane
            holds at the end of the stream instead of emitting it.

    Returns:
        A new pipeline.

    Raises:
        ValueError: ``microbatch_size`` is not a positive integer.
    """
    return _append(self, Batch, locals())
