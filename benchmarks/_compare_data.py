"""Data for ``compare.py``: a generated text corpus, its tokenizer and its token shards.

Everything is generated here, deterministically from a seed, and cached under
``benchmarks/.data/compare`` (nothing is downloaded):

* a vocabulary of 30,000 synthetic words (syllables glued together), drawn
  with Zipf-like frequencies, so the byte-level BPE has real merges to learn;
* JSONL shards of about 4 MB, ``{"text": ...}`` per line, whose document
  lengths (in words) follow one of :data:`LENGTHS` (``"heavy"`` by default: a
  log-normal with a long tail, so some documents exceed a 2049-token row);
* a 32k byte-level BPE trained on the first shard, with ``<|pad|>`` (id 0)
  and ``<|endoftext|>`` (id 1) as special tokens;
* Parquet shards with one ``input_ids`` column (``list<int32>``): every
  document of the JSONL corpus encoded by that tokenizer, EOS appended, one
  Parquet file per JSONL shard and row groups of 1024 documents;
* the same token corpus laid out with several row groups per shard (the
  ``token-rg`` job), as published Parquet corpora are: the documents in the
  same order, cut into shards of :data:`RG_SHARD_DOCS` documents (4,608) in
  row groups of 1024, so 5 row groups per shard (the JSONL shards above hold
  about 1,950 documents, so their token shards have 2 row groups).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "compare"
ROW = 2049  # tokens per packed row: a 2048-token model input plus the shifted label
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 32_768
SHARD_BYTES = 4_000_000
ROW_GROUP = 1024
RG_SHARD_DOCS = 4608  # documents per Parquet shard of the many-row-group layout
ENCODE_BATCH = 256  # texts per encode_batch call, for every contender

#: Document length distributions, in words: (log-normal mean, sigma) of ln(words).
LENGTHS: dict[str, tuple[float, float]] = {
    "short": (3.5, 0.6),   # chat-like: ~40 words, rarely more than 200
    "heavy": (5.0, 1.1),   # web-like: median ~150 words, a long tail past one row
    "long": (7.0, 0.5),    # book-like: ~1,100 words, most documents span rows
}

_SYLLABLES = ("ka ri to na mi su le po da ve ch sh th an en in on un er or ar al el il ol "
              "qu st pr tr br gr bl cl fl gl pl sl x z y w").split()


def _vocabulary(rng: np.random.Generator, size: int = 30_000) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        n = int(rng.integers(1, 5))
        words.add("".join(_SYLLABLES[i] for i in rng.integers(0, len(_SYLLABLES), n)))
    ordered = sorted(words)
    rng.shuffle(ordered)  # frequency rank independent of spelling
    return ordered


def make_corpus(mb: float, lengths: str = "heavy", seed: int = 0) -> Path:
    """JSONL shards of about 4 MB holding ``mb`` megabytes of documents in all."""
    folder = DATA / f"text-{lengths}-{mb:g}mb-s{seed}"
    if (folder / ".done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = np.array(_vocabulary(np.random.default_rng(1234)), dtype=object)
    ranks = np.arange(1, len(vocab) + 1, dtype=np.float64)
    weights = 1.0 / ranks**1.07
    cdf = np.cumsum(weights / weights.sum())
    mu, sigma = LENGTHS[lengths]
    target, written, shard = int(mb * 1e6), 0, 0
    while written < target:
        lines: list[str] = []
        size = 0
        while size < SHARD_BYTES and written + size < target:
            n = max(1, int(rng.lognormal(mu, sigma)))
            words = vocab[np.minimum(np.searchsorted(cdf, rng.random(n)), len(vocab) - 1)]
            # Sentences of ~12 words, so the text has punctuation and capitals too.
            text = " ".join(
                (w.capitalize() if i % 12 == 0 else w) + ("." if i % 12 == 11 else "")
                for i, w in enumerate(words)
            )
            line = json.dumps({"text": text}) + "\n"
            lines.append(line)
            size += len(line)
        (folder / f"part-{shard:04d}.jsonl").write_text("".join(lines))
        written += size
        shard += 1
    (folder / ".done").touch()
    return folder


def make_tokenizer() -> Path:
    """A 32k byte-level BPE trained on the first shard of the default corpus."""
    path = DATA / "tokenizer-32k.json"
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = make_corpus(4, "heavy", seed=99)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[PAD_TOKEN, EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    first = sorted(corpus.glob("*.jsonl"))[0]
    texts = [json.loads(line)["text"] for line in first.read_text().splitlines()]
    tok.train_from_iterator(texts, trainer)
    DATA.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def make_token_shards(corpus: Path, tokenizer: Path) -> Path:
    """Parquet shards of the corpus, pre-tokenized: one ``list<int32>`` column, EOS appended."""
    folder = corpus.with_name(corpus.name.replace("text-", "tokens-", 1))
    if (folder / ".done").exists():
        return folder
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id(EOS_TOKEN)
    for src in sorted(corpus.glob("*.jsonl")):
        texts = [json.loads(line)["text"] for line in src.read_text().splitlines()]
        docs: list[list[int]] = []
        for start in range(0, len(texts), ENCODE_BATCH):
            for enc in tok.encode_batch(texts[start:start + ENCODE_BATCH],
                                        add_special_tokens=False):
                docs.append([*enc.ids, eos])
        column = pa.array(docs, type=pa.list_(pa.int32()))
        table = pa.table({"input_ids": column})
        pq.write_table(table, folder / (src.stem + ".parquet"), row_group_size=ROW_GROUP)
    (folder / ".done").touch()
    return folder


def make_token_shards_rg(corpus: Path, tokenizer: Path) -> Path:
    """The token shards of ``corpus`` in the many-row-group layout: the documents in
    order, :data:`RG_SHARD_DOCS` per file, row groups of :data:`ROW_GROUP` documents."""
    folder = corpus.with_name(corpus.name.replace("text-", f"tokens-rg{RG_SHARD_DOCS}-", 1))
    if (folder / ".done").exists():
        return folder
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = parquet_files(make_token_shards(corpus, tokenizer))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    folder.mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, table.num_rows, RG_SHARD_DOCS)):
        pq.write_table(table.slice(start, RG_SHARD_DOCS), folder / f"part-{shard:04d}.parquet",
                       row_group_size=ROW_GROUP)
    (folder / ".done").touch()
    return folder


def jsonl_files(corpus: Path) -> list[Path]:
    """The JSONL shards of a corpus, in order."""
    return sorted(corpus.glob("*.jsonl"))


def parquet_files(shards: Path) -> list[Path]:
    """The Parquet shards of a token corpus, in order."""
    return sorted(shards.glob("*.parquet"))
