"""A small, real byte-level BPE tokenizer trained at test time.

Tests that need a tokenizer must not download one, and a mock would hide the
very behaviour we want to check (how ``tokenizers`` splits text, which ids its
special tokens get). So we train a genuine byte-level BPE with the
``tokenizers`` library on text generated from a fixed seed. Training on the
~100 KB corpus takes a few tens of milliseconds and, given the same corpus, is
deterministic (the merges are chosen by count with a fixed tie-break), so the
ids a test sees are the same on every run and machine.

Example::

    tok, path = train_test_tokenizer(tmp_path)
    tok.token_to_id("<|endoftext|>")    # 0: special tokens come first
    tok.encode("the lane", add_special_tokens=False).ids

The corpus mixes invented words (from syllables), a few fixed English words
that tests like to use, digits and punctuation. Because the alphabet is the
full byte-level alphabet, any UTF-8 string can be encoded.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["SPECIAL_TOKENS", "train_test_tokenizer"]

#: The special tokens of the default test tokenizer, in id order (0, 1, 2, 3).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<s>", "</s>", "<pad>")

_SYLLABLES = (
    "ka", "zo", "phe", "lin", "tra", "mu", "sev", "dor", "qui", "bex", "al", "on",
    "ri", "st", "ne", "gu", "whe", "ty", "pa", "cho", "em", "vi", "lo", "sha",
)
_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "data", "pipeline",
    "token", "model", "train", "shard", "lane", "chunk", "offset", "packing", "shuffle",
    "batch", "hello", "world", "user", "assistant", "system", "answer", "question",
)
_PUNCT = (".", ",", "!", "?", ":", ";", "")

# Trained tokenizer JSON per (special tokens, vocab size): training is cheap,
# but several test modules call this, and one training per process is enough.
_CACHE: dict[tuple[tuple[str, ...], int], str] = {}


def _corpus(seed: int = 20240611, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(3, 14)):
            if rng.random() < 0.45:
                words.append(rng.choice(_WORDS))
            elif rng.random() < 0.1:
                words.append(str(rng.randint(0, 9999)))
            else:
                words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
        line = " ".join(words) + rng.choice(_PUNCT)
        out.append(line.capitalize() if rng.random() < 0.3 else line)
    return out


def _train(special_tokens: tuple[str, ...], vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    # No prefix space: a string encodes the same on its own as at the start
    # of a text, which keeps the expected ids in tests simple to reason about.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def train_test_tokenizer(
    tmp_dir: str | os.PathLike[str],
    *,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    vocab_size: int = 768,
) -> tuple[Tokenizer, Path]:
    """Train (or reuse) a small byte-level BPE and save it as ``tokenizer.json``.

    Args:
        tmp_dir: Directory to write ``tokenizer.json`` into (created if needed).
        special_tokens: Special tokens, given ids ``0, 1, ...`` in this order.
            Pass ``()`` for a tokenizer without any.
        vocab_size: Target vocabulary size, special tokens included.

    Returns:
        A fresh ``tokenizers.Tokenizer`` (the caller may change it freely) and
        the path of the saved ``tokenizer.json``.
    """
    key = (tuple(special_tokens), int(vocab_size))
    text = _CACHE.get(key)
    if text is None:
        text = _CACHE[key] = _train(*key)
    directory = Path(tmp_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_text(text, encoding="utf-8")
    return Tokenizer.from_str(text), path
