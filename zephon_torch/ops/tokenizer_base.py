"""The shared base of the tokenizing operators (``tokenize``, ``tokenize_chat``).

:class:`TokenizerOperator` holds what both need: the tokenizer as JSON, its
lazy rebuild in each process, the special ids a ``special_tokens`` mode asks
for, batched encoding with a per-sample retry, and the rejection of a bad
sample (an error naming its file and line, or a tombstone).

Why the tokenizer travels as JSON. An operator is pickled to worker
processes; the Rust tokenizer object is not something to pickle by reference.
The operator keeps the tokenizer's JSON (``Tokenizer.to_str()``, normalized by
:func:`~zephon_torch.ops.tokenizer_loading.load_tokenizer`) and each process
rebuilds it once, lazily, on first use (it is left out of the pickled state).

A text the tokenizer cannot encode (a lone UTF-16 surrogate, which is not
Unicode) makes the batched call fail; the operator then encodes each sample
on its own (:meth:`TokenizerOperator._encode_apart`) to find the failing
one(s), so what fails depends on the sample alone, never on its neighbours or
the micro-batch size::

    encode_batch(["ok", "bad \\ud800", "fine"])   -> fails
    encode(["ok"]), encode(["bad \\ud800"]), encode(["fine"])
                                                  -> ids, error, ids
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
from tokenizers import Tokenizer

from zephon_torch.ops.base import OpContext, Operator, OpTraits, tombstone
from zephon_torch.ops.io import _lone_surrogate
from zephon_torch.ops.tokenizer_loading import (
    BOS_TOKEN_CANDIDATES,
    EOS_TOKEN_CANDIDATES,
    TokenizerSource,
    load_tokenizer,
    special_token_id,
    tokenizer_sha256,
)
from zephon_torch.sources.base import Dataset
from zephon_torch.types import SampleRecord

__all__ = [
    "SPECIAL_TOKEN_MODES",
    "TokenizerOperator",
    "check_choice",
    "check_field_name",
    "unencodable",
]

#: Accepted values of ``special_tokens``.
SPECIAL_TOKEN_MODES: tuple[str, ...] = ("bos_eos", "eos", "bos", "none")

_ON_ERROR = ("raise", "skip")
# Which special tokens each mode adds.
_WANTS: dict[str, tuple[str, ...]] = {
    "bos_eos": ("bos", "eos"), "eos": ("eos",), "bos": ("bos",), "none": (),
}


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_field_name(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a non-empty string (a payload key)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


class TokenizerOperator(Operator):
    """Shared machinery: the tokenizer as JSON, its lazy rebuild, special ids."""

    #: Between the sample id and the problem in error messages.
    _separator: ClassVar[str] = " "
    #: The most ids a sample keeps (``None``: no cut); each operator sets it.
    max_length: int | None

    def traits(self) -> OpTraits:
        """Elementwise: consecutive elementwise stages may be fused."""
        return OpTraits(elementwise=True)

    def _init_tokenizer(self, tokenizer: Any, *, special_tokens: str,
                        bos_token_id: int | None, eos_token_id: int | None,
                        on_error: str) -> TokenizerSource:
        """Load the tokenizer and resolve the special ids ``special_tokens`` needs.

        Returns what the tokenizer argument provides (its configured special
        tokens and chat template), for ``tokenize_chat``.
        """
        check_choice("special_tokens", special_tokens, SPECIAL_TOKEN_MODES)
        check_choice("on_error", on_error, _ON_ERROR)
        source = (tokenizer if isinstance(tokenizer, TokenizerSource)
                  else load_tokenizer(tokenizer))
        self._tokenizer_json = source.json
        self.tokenizer_sha256 = tokenizer_sha256(self._tokenizer_json)
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
            found, where = special_token_id(tok, source, which, explicit, candidates)
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
                self.pad_token_id = special_token_id(tok, source, "pad", None, ())[0]
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

    def _tokenizer_config(self) -> dict[str, Any]:
        """The part of :meth:`config` both operators share: special tokens, length cut,
        error mode and the tokenizer's fingerprint (in the order the configs list them)."""
        return {
            "special_tokens": self.special_tokens,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "max_length": self.max_length,
            "on_error": self.on_error,
            "tokenizer_sha256": self.tokenizer_sha256,
        }

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


def unencodable(what: str, text: str, exc: Exception) -> str:
    """Why ``text`` (described by ``what``) cannot be tokenized."""
    surrogate = _lone_surrogate(text)
    if surrogate is not None:
        return (f"{what} holds a lone UTF-16 surrogate {surrogate} (not valid Unicode, so "
                "the tokenizer cannot encode it; often half of an emoji cut by a scraper)")
    return f"{what} cannot be tokenized ({type(exc).__name__}: {exc})"

