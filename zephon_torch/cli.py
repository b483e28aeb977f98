"""The ``zephon-torch`` command: ``demo``, ``inspect`` and ``bench``.

``zephon-torch demo`` is the first thing a new user runs. In a few seconds
it shows the whole promise of the library on data it makes itself:

1. it writes a corpus of generated documents with heavy-tailed lengths
   (JSONL shards) and trains a byte-level BPE on it (nothing is downloaded);
2. it runs the canonical pipeline, ``from_jsonl -> fetch -> decode_text ->
   tokenize (EOS) -> pack_flat -> shuffle -> batch``, to the end with a
   progress bar (samples/s and tokens/s), turning each batch into training
   tensors with ``to_training`` as a training loop would;
3. it prints a sample batch: the decoded documents of the first row, their
   ``positions`` (restarting at 0 for each document) and ``cu_seqlens``;
4. it runs the pipeline again, stops half-way and writes
   ``iterator.state_dict()`` to a JSON file (the "crash");
5. it builds a fresh pipeline and iterator, loads that file, runs to the end
   and compares every batch with the uninterrupted run, printing ``resume:
   identical (N batches compared)``, or exiting with status 1::

       uninterrupted   b0 b1 b2 b3 b4 b5 b6 b7
       interrupted     b0 b1 b2 b3 | state_dict() -> checkpoint.json
       resumed                       b4 b5 b6 b7   == b4..b7 above, byte for byte

``zephon-torch inspect 'data/*.jsonl' --tokenizer tokenizer.json`` previews
a few batches of the user's own JSONL/Parquet/text files through the same
pipeline (decoded text, shapes, padding, the iterator's ``stats()``).
``zephon-torch bench [NAME] [ARGS]`` runs ``benchmarks/bench_NAME.py`` of a
source checkout (``pipeline`` by default), passing the arguments through.

The command imports torch only where tensors are made (``to_training``).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from zephon_torch.pipeline import Pipeline
from zephon_torch.sources.formats.registry import CommandLineFormat, command_line_formats
from zephon_torch.types import SampleBatch

__all__ = ["main"]

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
_SHARDS = 4
_NUM_LANES = 4
#: ``inspect --shuffle-buffer``'s default.
_SHUFFLE_BUFFER = 1024


# --------------------------------------------------------------------------- progress


class _Progress:
    """Batches, samples and tokens per second: a tqdm bar on a terminal, plain lines otherwise.

    Plain mode prints a line every ``every`` seconds (none for a short run);
    the caller prints the final summary in both modes from :meth:`close`.
    """

    def __init__(self, label: str, *, total: int | None = None, enabled: bool = True,
                 out: TextIO | None = None, every: float = 5.0) -> None:
        self.label = label
        self.out = out or sys.stdout
        self.every = every
        self.batches = self.samples = self.tokens = 0
        self.started = self._shown = time.perf_counter()
        self._bar: Any = None
        if enabled and self.out.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # the plain lines will do
                pass
            else:
                # tqdm glues the unit to the count ("333batch"): the space is ours.
                self._bar = tqdm(total=total, desc=f"  {label}", unit=" batches",
                                 file=self.out, dynamic_ncols=True, leave=True)

    def rates(self) -> tuple[float, float, float]:
        """Elapsed seconds, samples/s, tokens/s."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return elapsed, self.samples / elapsed, self.tokens / elapsed

    def update(self, samples: int, tokens: int) -> None:
        """Count one batch of ``samples`` rows holding ``tokens`` non-pad tokens."""
        self.batches += 1
        self.samples += samples
        self.tokens += tokens
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(1)
            if now - self._shown >= 0.2:  # formatting every batch would cost more than it shows
                _, per_sample, per_token = self.rates()
                self._bar.set_postfix_str(f"{per_sample:,.0f} samples/s, "
                                          f"{per_token:,.0f} tokens/s", refresh=False)
                self._shown = now
        elif now - self._shown >= self.every:
            _, per_sample, per_token = self.rates()
            print(f"  {self.label}: {self.batches} batches, {per_sample:,.0f} samples/s, "
                  f"{per_token:,.0f} tokens/s", file=self.out, flush=True)
            self._shown = now

    def close(self) -> tuple[float, float, float]:
        """Stop the bar; return :meth:`rates`."""
        result = self.rates()
        if self._bar is not None:
            _, per_sample, per_token = result
            self._bar.set_postfix_str(f"{per_sample:,.0f} samples/s, {per_token:,.0f} tokens/s")
            self._bar.close()
        return result


# --------------------------------------------------------------------------- helpers


def _canonical(source: Pipeline, tokenizer: Any, *, seq_len: int, batch_size: int,
               pad_id: int, field: str = "text", shuffle_buffer: int = 256,
               seed: int = 0) -> Pipeline:
    """``source -> fetch -> decode_text -> tokenize(EOS) -> pack_flat -> shuffle -> batch``."""
    return (
        source.fetch()
        .decode_text(field)
        .tokenize(tokenizer, field=field, special_tokens="eos")
        .pack_flat(seq_len + 1, pad_token_id=pad_id)
        .shuffle(shuffle_buffer, seed=seed + 1)
        .batch(batch_size, drop_last=True)
    )


def _row_tokens(batch: SampleBatch) -> int:
    """Non-pad tokens of a packed batch."""
    return sum(len(r.payload["input_ids"]) - (r.meta.padding_length or 0) for r in batch)


def _digest(batch: SampleBatch) -> str:
    """What makes two batches the same: sample ids, tokens and positions of every row."""
    h = hashlib.sha256()
    for record in batch:
        h.update(repr(record.meta.sample_id).encode())
        for key in ("input_ids", "positions"):
            h.update(np.ascontiguousarray(record.payload[key]).tobytes())
    return h.hexdigest()


def _consume(it: Iterator[SampleBatch], progress: _Progress, *,
             limit: int | None = None) -> tuple[list[str], SampleBatch | None]:
    """Take batches as a training loop would (``to_training`` included in the timing).

    Returns the digest of every batch taken (at most ``limit``) and the first batch.
    """
    digests: list[str] = []
    first = None
    for batch in it:
        batch.to_training(return_labels=True, return_cu_seqlens=True)
        digests.append(_digest(batch))
        if first is None:
            first = batch
        progress.update(len(batch), _row_tokens(batch))
        if limit is not None and len(digests) >= limit:
            break
    return digests, first


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _runs(values: Sequence[int], starts: Sequence[int], limit: int = 3) -> str:
    """``positions`` of a row, segment by segment: ``0 1 2 ... 36 | 0 1 ... 60 | ...``."""
    parts = []
    bounds = [*starts, len(values)]
    for a, b in itertools.islice(itertools.pairwise(bounds), limit):
        seg = list(values[a:b])
        shown = seg if len(seg) <= 6 else [*seg[:3], "...", *seg[-2:]]
        parts.append(" ".join(str(v) for v in shown))
    more = " | ..." if len(bounds) - 1 > limit else ""
    return " | ".join(parts) + more


def _tensors(out: dict[str, Any], keys: Sequence[str]) -> str:
    """Shapes and dtypes, each dtype after the run of tensors that have it:
    ``input_ids [8, 256], labels [8, 256] (torch.int64), cu_seqlens [8, 12] (torch.int32)``."""
    groups: list[tuple[Any, list[str]]] = []
    for key in keys:
        dtype = out[key].dtype
        if not groups or groups[-1][0] != dtype:
            groups.append((dtype, []))
        groups[-1][1].append(f"{key} {list(out[key].shape)}")
    return ", ".join(f"{', '.join(shapes)} ({dtype})" for dtype, shapes in groups)


def _show_batch(batch: SampleBatch, tokenizer: Any, *, docs: int = 3, width: int = 72) -> None:
    """Shapes of the training tensors, then one row: its documents, positions, cu_seqlens.

    The row shown is the first holding several documents (row 0 when none
    does), since that is where ``positions`` and ``cu_seqlens`` say something.
    """
    out = batch.to_training(return_labels=True, return_cu_seqlens=True,
                            return_num_valid_tokens=True)
    print(f"  tensors: {_tensors(out, ('input_ids', 'labels', 'positions', 'cu_seqlens'))}; "
          f"{out['num_valid_tokens']:,} labels not ignored")
    length = out["input_ids"].shape[1]
    # Row i's segment starts: its cu_seqlens without the padding repeats of the length.
    starts = [sorted({c for c in row if c < length}) for row in out["cu_seqlens"].tolist()]
    row = next((i for i, s in enumerate(starts) if len(s) >= 3), 0)
    ids = out["input_ids"][row].tolist()
    padding = batch[row].meta.padding_length or 0
    # The trailing padding is a segment of its own once it spans 2+ input positions.
    documents = len(starts[row]) - (1 if padding > 1 else 0)
    print(f"  row {row} holds {documents} document(s)"
          + (f" and {padding} padding token{'s' if padding > 1 else ''}" if padding else "")
          + f"; its cu_seqlens {[*starts[row], length]}")
    print(f"  positions (restart at each document): "
          f"{_runs(out['positions'][row].tolist(), starts[row])}")
    bounds = [*starts[row], length]
    for k in range(min(docs, documents)):
        a, b = bounds[k], bounds[k + 1]
        text = tokenizer.decode(ids[a:b], skip_special_tokens=True)
        print(f"    doc {k} ({b - a} tokens): {_clip(text, width)!r}")


@contextmanager
def _workdir(out: str | None) -> Iterator[Path]:
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="zephon-demo-") as tmp:
            yield Path(tmp)


# --------------------------------------------------------------------------- demo


def _write_corpus(folder: Path, texts: Sequence[str]) -> list[str]:
    """JSONL shards, documents dealt round-robin; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(_SHARDS):
        path = folder / f"part-{shard:05d}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for i in range(shard, len(texts), _SHARDS):
                f.write(json.dumps({"id": i, "text": texts[i]}) + "\n")
        paths.append(str(path))
    return paths


def _demo_inputs(out: Path, args: argparse.Namespace) -> tuple[Any, Path, int]:
    """Write the corpus, train and save the tokenizer; returns it, its path, the EOS id."""
    from zephon_torch.demo import EOS, default_corpus, train_tokenizer

    texts = default_corpus(args.docs, seed=args.seed)
    paths = _write_corpus(out / "corpus", texts)
    words = np.array([len(t.split()) for t in texts])
    size = sum(os.path.getsize(p) for p in paths)
    print(f"corpus:    {len(texts):,} documents in {_SHARDS} JSONL shards, "
          f"{size / 1e6:.1f} MB, {int(np.median(words))} words median, "
          f"{int(words.max()):,} max -> {out / 'corpus'}")
    started = time.perf_counter()
    tokenizer = train_tokenizer(texts)
    tokenizer_path = out / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    eos = tokenizer.token_to_id(EOS)
    print(f"tokenizer: byte-level BPE, {tokenizer.get_vocab_size()} ids, trained in "
          f"{time.perf_counter() - started:.1f} s, EOS {EOS} = {eos} -> {tokenizer_path}")
    return tokenizer, tokenizer_path, eos


def _accounting(stats: dict[str, Any]) -> str:
    reasons: dict[str, int] = {}
    for lane in stats["lanes"].values():
        for reason, count in lane["tombstoned"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    because = f" {reasons}" if reasons else ""
    return (f"{stats['read']:,} documents read = {stats['delivered']:,} delivered + "
            f"{stats['tombstoned']:,} tombstoned{because}")


def _demo(args: argparse.Namespace) -> int:
    if args.docs < 1 or args.seq_len < 2 or args.batch_size < 1:
        raise SystemExit("--docs and --batch-size must be >= 1 and --seq-len >= 2")
    show = not args.no_progress
    run = {"runner": args.runner, "num_workers": args.num_workers}
    print("zephon-torch demo: the canonical pipeline on a generated corpus, checkpointed "
          "mid-way and resumed exactly")
    with _workdir(args.out) as out:
        tokenizer, tokenizer_path, eos = _demo_inputs(out, args)

        def build() -> Pipeline:
            # Built from the files each time: a restarted job has its config, not our objects.
            source = Pipeline.from_jsonl(str(out / "corpus" / "*.jsonl"), num_lanes=_NUM_LANES,
                                         chunk_size=64, seed=args.seed)
            return _canonical(source, str(tokenizer_path), seq_len=args.seq_len,
                              batch_size=args.batch_size, pad_id=eos, seed=args.seed)

        pipe = build()
        print(f"pipeline:  {pipe}: rows of {args.seq_len + 1} tokens ({args.seq_len} inputs "
              f"+ labels), batches of {args.batch_size}, {_NUM_LANES} lanes, "
              f"runner={args.runner} x{args.num_workers}")
        import torch  # noqa: F401  (to_training needs it: imported before the clock starts)

        print("\n[1/3] uninterrupted run")
        progress = _Progress("uninterrupted", enabled=show)
        with pipe.iter(**run) as it:
            reference, first = _consume(it, progress)
            stats = it.stats()
        elapsed, per_sample, per_token = progress.close()
        print(f"  {progress.batches} batches, {progress.samples:,} samples (packed rows), "
              f"{progress.tokens:,} tokens in {elapsed:.2f} s: {per_sample:,.0f} samples/s, "
              f"{per_token:,.0f} tokens/s")
        print(f"  accounting: {_accounting(stats)}")
        if first is None or len(reference) < 2:
            print("error: fewer than 2 batches; use more --docs or a smaller --seq-len")
            return 1
        print("\nsample batch (the first one):")
        _show_batch(first, tokenizer)

        cut = len(reference) // 2
        checkpoint = out / "checkpoint.json"
        print(f"\n[2/3] interrupted run: stop after {cut} of {len(reference)} batches, save "
              f"state_dict()")
        progress = _Progress("to checkpoint", total=cut, enabled=show)
        with pipe.iter(**run) as it:
            before, _ = _consume(it, progress, limit=cut)
            checkpoint.write_text(json.dumps(it.state_dict()))
        progress.close()
        print(f"  {len(before)} batches; state -> {checkpoint} "
              f"({checkpoint.stat().st_size / 1024:.1f} KiB of JSON)")

        print(f"\n[3/3] resumed run: a fresh pipeline and iterator, load_state_dict() from "
              f"{checkpoint.name}")
        progress = _Progress("resumed", total=len(reference) - cut, enabled=show)
        with build().iter(**run) as it:
            it.load_state_dict(json.loads(checkpoint.read_text()))
            after, _ = _consume(it, progress)
        elapsed, _, _ = progress.close()
        print(f"  {len(after)} batches in {elapsed:.2f} s")

    if before == reference[:cut] and after == reference[cut:]:
        print(f"\nresume: identical ({len(after)} batches compared)")
        return 0
    expected = reference[cut:]
    mismatch = next((i for i, (a, b) in enumerate(zip(after, expected)) if a != b),
                    min(len(after), len(expected)))
    print(f"\nresume: DIFFERENT: {len(after)} batches after the checkpoint, {len(expected)} "
          f"expected; first difference at batch {cut + mismatch}")
    return 1


# --------------------------------------------------------------------------- inspect


class _UsageError(Exception):
    """A problem with the command's input, shown as one ``error:`` line (no traceback)."""


def _formats() -> dict[str, CommandLineFormat]:
    """The formats ``--format`` can name (the registry's), by that name."""
    return {name: f.command_line for name, f in command_line_formats().items()
            if f.command_line is not None}


def _one_of(words: Sequence[str]) -> str:
    """``"a, b or c"``."""
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else list(words))


def _format_of(name: str) -> str | None:
    """The format a path or glob names by its extension (None: it names none)."""
    name = name.lower()
    for fmt in sorted(_formats().values(), key=lambda f: f.rank):
        if fmt.names(name):
            return fmt.name
    return None


def _folder_files(folder: Path, fmt: str) -> tuple[str, list[str]]:
    """The format and files of a folder argument: the files of the one format it holds.

    Raises:
        _UsageError: The folder holds files of no format, or of several (and
            ``fmt`` does not choose).
    """
    formats = _formats()
    files = sorted(p for p in folder.iterdir() if p.is_file())
    found = {kind: [str(p) for p in files if p.name.lower().endswith(f.suffixes)]
             for kind, f in formats.items()}
    if fmt != "auto":
        if not found[fmt]:
            raise _UsageError(f"the folder {str(folder)!r} holds no {fmt} file (names ending "
                              f"in {', '.join(formats[fmt].suffixes)}); pass a glob of its "
                              f"files, such as '{folder}/*'")
        return fmt, found[fmt]
    kinds = [kind for kind, paths in found.items() if paths]
    if len(kinds) == 1:
        return kinds[0], found[kinds[0]]
    if not kinds:
        labels = _one_of([f.label for f in formats.values()])
        examples = ", ".join(f.suffixes[0] for f in formats.values())
        raise _UsageError(f"the folder {str(folder)!r} holds no {labels} file "
                          f"({examples}, ...); pass a glob of the files to read "
                          f"with --format {_one_of(list(formats))}")
    counts = ", ".join(f"{len(found[kind])} {kind}" for kind in kinds)
    raise _UsageError(f"the folder {str(folder)!r} holds files of several formats ({counts}); "
                      f"pass --format {' or '.join(kinds)}, or a glob such as "
                      f"'{folder}/*{formats[kinds[0]].suffixes[0]}'")


def _source_for(pattern: str, fmt: str, **config: Any) -> Pipeline:
    """The source of ``inspect``'s PATH_OR_GLOB: files, a glob, or a folder of one format.

    Raises:
        _UsageError: The format cannot be told (pass ``--format``).
    """
    paths: str | list[str] = pattern
    if "://" not in pattern and Path(pattern).is_dir():
        fmt, paths = _folder_files(Path(pattern), fmt)
    elif fmt == "auto":
        named = _format_of(pattern)
        if named is None:
            raise _UsageError(f"cannot tell the format of {pattern!r} from its name; pass "
                              f"--format {_one_of(list(_formats()))}")
        fmt = named
    dataset = command_line_formats()[fmt].open(paths)
    return Pipeline.from_sources([dataset], **config)


def _first_payload(source: Pipeline) -> tuple[Any, str] | None:
    """The payload of the first document the pipeline reads, and where it is; None: no data.

    JSON lines are parsed here (a line that does not parse is left for the
    pipeline to report); text files always give text, so they are not read.
    """
    dataset = source.source.datasets[0]
    if dataset.kind == "text_files":
        return None
    with source.fetch().iter(runner="inline") as it:
        record = next(iter(it), None)
    if record is None:
        return None
    _, shard, local = record.meta.sample_id
    where = dataset.locate(shard, local)
    payload = record.payload
    if isinstance(payload, (bytes, bytearray, memoryview, str)):
        try:
            payload = json.loads(bytes(payload) if not isinstance(payload, str) else payload)
        except ValueError:
            return None
    return payload, where


def _a(value: Any) -> str:
    """The type of ``value`` with its article, for a message: ``"an int"``, ``"a list"``."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _is_chat(value: Any) -> bool:
    """A list of ``{"role": ..., "content": ...}`` messages."""
    return isinstance(value, list) and any(isinstance(m, dict) and "role" in m for m in value)


def _check_text_field(source: Pipeline, field: str) -> None:
    """Stop with one clear line when the first document holds no text under ``field``.

    Raises:
        _UsageError: The field is missing, holds chat messages, or is not a string.
    """
    found = _first_payload(source)
    if found is None:
        return
    payload, where = found
    if not isinstance(payload, dict):
        raise _UsageError(f"{where} holds {_a(payload)}, not an object with a {field!r} "
                          "field; inspect previews JSON objects with a text field")
    if field not in payload:
        keys = ", ".join(repr(k) for k in list(payload)[:12]) or "none"
        chats = [k for k, v in payload.items() if _is_chat(v)]
        if chats and not any(isinstance(v, str) for v in payload.values()):
            raise _UsageError(
                f"{where} has no field {field!r} (its fields: {keys}) and its {chats[0]!r} "
                "holds chat messages; inspect previews plain-text documents: tokenize chat "
                "data in a pipeline with Pipeline.tokenize_chat()")
        raise _UsageError(f"{where} has no field {field!r} (its fields: {keys}); pass "
                          "--field with the name of the field that holds the text")
    value = payload[field]
    if _is_chat(value):
        raise _UsageError(
            f"field {field!r} of {where} holds chat messages, not text; inspect previews "
            "plain-text documents: pass --field with a text field, or tokenize chat data "
            "in a pipeline with Pipeline.tokenize_chat()"
        )
    if not isinstance(value, str):
        raise _UsageError(f"field {field!r} of {where} holds {_a(value)}, not text; pass "
                          "--field with the name of the field that holds the text")


def _load_tokenizer(tokenizer: Any, field: str) -> tuple[Any, int | None]:
    """The tokenizer (a path, or a trained one) and its EOS id, as the pipeline loads them.

    Raises:
        _UsageError: No such file or folder, not a tokenizer, or no EOS token.
    """
    from zephon_torch.ops.tokenize import Tokenize

    try:
        # The operator reads the file, resolves EOS the way the pipeline will,
        # and says what is wrong when it cannot.
        op = Tokenize(tokenizer, field=field, special_tokens="eos")
    except (FileNotFoundError, ValueError, TypeError) as exc:
        if not isinstance(tokenizer, (str, os.PathLike)):
            raise _UsageError(f"the tokenizer trained on your documents: {exc}") from exc
        if isinstance(exc, FileNotFoundError):
            # Often a model name, as transformers takes: say how to get its tokenizer.json.
            raise _UsageError(
                f"--tokenizer {tokenizer}: {exc}; nothing is downloaded: for a Hugging Face "
                "model, save its tokenizer first (AutoTokenizer.from_pretrained(name)"
                ".save_pretrained('tok')) and pass --tokenizer tok") from exc
        raise _UsageError(f"--tokenizer {tokenizer}: {exc}") from exc
    return op.tokenizer, op.eos_token_id


def _inspect(args: argparse.Namespace) -> int:
    try:
        return _inspect_checked(args)
    except BrokenPipeError:  # `| head`: main() handles it
        raise
    except (_UsageError, ValueError, OSError, ImportError) as exc:
        # Problems with the user's files, options or environment: one line, no traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _inspect_checked(args: argparse.Namespace) -> int:
    if args.shuffle_buffer <= args.num_lanes:
        raise _UsageError(
            f"--shuffle-buffer {args.shuffle_buffer} over --num-lanes {args.num_lanes} gives "
            f"each lane a buffer of one row, which does not shuffle: the buffer is shared by "
            f"the lanes. Pass --shuffle-buffer {args.num_lanes + 1} or more (this command's "
            f"default is {_SHUFFLE_BUFFER}), or fewer --num-lanes")
    config = {"num_lanes": args.num_lanes, "chunk_size": args.chunk_size, "seed": args.seed}
    source = _source_for(args.path, args.format, **config)
    _check_text_field(source, args.field)
    if args.tokenizer:
        tokenizer, eos = _load_tokenizer(args.tokenizer, args.field)
        origin = args.tokenizer
    else:
        from zephon_torch.demo import train_tokenizer

        sample_pipe = source.fetch().decode_text(args.field)
        with sample_pipe.iter(runner="inline") as it:
            texts = [r.payload.get(args.field) for _, r in zip(range(2000), it)]
        texts = [t for t in texts if isinstance(t, str)]
        tokenizer, eos = _load_tokenizer(train_tokenizer(texts), args.field)
        origin = (f"a BPE trained on {len(texts)} of your documents (pass --tokenizer "
                  "for your model's)")
    pipe = _canonical(source, tokenizer, seq_len=args.seq_len, batch_size=args.batch_size,
                      pad_id=eos if eos is not None else 0, field=args.field,
                      shuffle_buffer=args.shuffle_buffer, seed=args.seed)
    datasets = source.source.datasets
    print(f"source:    {args.path} ({', '.join(d.kind for d in datasets)}; "
          f"{sum(len(d) for d in datasets):,} documents)")
    print(f"tokenizer: {origin}; {tokenizer.get_vocab_size():,} ids, EOS id {eos}")
    print(f"pipeline:  {pipe}: rows of {args.seq_len + 1}, batches of {args.batch_size}, "
          f"{args.num_lanes} lanes")
    total_rows = total_pad = total_slots = 0
    with pipe.iter(runner=args.runner, num_workers=args.num_workers) as it:
        for index in range(args.batches):
            try:
                batch = next(it)
            except StopIteration:
                print(f"(the data ends after {index} batches)")
                break
            pad = sum(r.meta.padding_length or 0 for r in batch)
            slots = sum(len(r.payload["input_ids"]) for r in batch)
            docs = [len(r.meta.contributors) for r in batch]
            total_rows += len(batch)
            total_pad += pad
            total_slots += slots
            print(f"\nbatch {index} (lane {batch.lane_ids[0]}): {len(batch)} rows, documents "
                  f"per row {docs}, padding {pad / slots:.1%}")
            _show_batch(batch, tokenizer, docs=args.docs_shown)
        stats = it.stats()
    if total_slots:
        print(f"\n{total_rows} rows shown, padding {total_pad / total_slots:.1%} of "
              f"{total_slots:,} token slots")
    print(f"stats(): read {stats['read']:,}, delivered {stats['delivered']:,}, tombstoned "
          f"{stats['tombstoned']:,} (the rest is in flight or buffered)")
    for lane, entry in stats["lanes"].items():
        print(f"  lane {lane}: {entry}")
    for stage, counters in stats["stages"].items():
        print(f"  stage {stage}: {counters}")
    return 0


# --------------------------------------------------------------------------- bench


def _bench(argv: Sequence[str]) -> int:
    """Run ``benchmarks/bench_<name>.py`` with the remaining arguments."""
    available = sorted(p.stem[len("bench_"):] for p in _BENCHMARKS.glob("bench_*.py"))
    if not available:
        print(f"zephon-torch bench runs the benchmarks of a source checkout, and there are "
              f"none at {_BENCHMARKS} (an installed package does not ship them). Clone the "
              f"repository and run it from there, or: python benchmarks/bench_pipeline.py",
              file=sys.stderr)
        return 2
    argv = list(argv)
    name = "pipeline"
    if argv and not argv[0].startswith("-"):
        name = argv.pop(0)
    if name not in available:
        print(f"no benchmark {name!r}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    script = _BENCHMARKS / f"bench_{name}.py"
    if argv in (["-h"], ["--help"]):
        print(f"zephon-torch bench [NAME] [ARGS...]: runs benchmarks/bench_NAME.py "
              f"(NAME: {', '.join(available)}; default pipeline) with ARGS. "
              f"Its own options:\n", flush=True)
    return subprocess.call([sys.executable, str(script), *argv])


# --------------------------------------------------------------------------- main


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= minimum``, refused as typed (``error:``, status 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


_POSITIVE = _at_least(1)
_COUNT = _at_least(0)


class _HelpFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, except where there is none to show.

    Like ``argparse.ArgumentDefaultsHelpFormatter``, but silent for ``None``
    and ``False`` defaults (whose help says what happens without the option).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or default is False
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _parser() -> argparse.ArgumentParser:
    from zephon_torch import __version__

    parser = argparse.ArgumentParser(
        prog="zephon-torch", formatter_class=_HelpFormatter,
        description="zephon_torch: a deterministic, checkpointable data pipeline for LLM "
                    "training on PyTorch.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    runners = ["inline", "threads", "process"]

    demo = commands.add_parser(
        "demo", help="generate a corpus, run the canonical pipeline, checkpoint, resume",
        formatter_class=_HelpFormatter,
        description="Generate a corpus, train a tokenizer, run the canonical pipeline with "
                    "a progress bar, print a sample batch, checkpoint mid-way, resume in a "
                    "fresh iterator and prove the continuation is identical.")
    demo.add_argument("--runner", default="threads", choices=runners,
                      help="where the stages run (the output is the same with each)")
    demo.add_argument("--num-workers", type=_COUNT, default=2,
                      help="threads or processes of the runner")
    demo.add_argument("--docs", type=_POSITIVE, default=4000, help="documents to generate")
    demo.add_argument("--seq-len", type=_POSITIVE, default=256,
                      help="model sequence length; rows are one token longer, for labels")
    demo.add_argument("--batch-size", type=_POSITIVE, default=8, help="rows per batch")
    demo.add_argument("--seed", type=int, default=0, help="seed of the corpus and the orders")
    demo.add_argument("--out", help="keep corpus, tokenizer and checkpoint here "
                      "(default: a temporary folder)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")

    inspect = commands.add_parser(
        "inspect", help="preview batches of your data through the canonical pipeline",
        formatter_class=_HelpFormatter,
        description="Preview batches of JSONL, Parquet or text files through the canonical "
                    "pipeline: decoded text, shapes, padding, and the iterator's stats().")
    inspect.add_argument("path", metavar="PATH_OR_GLOB", help="files (a glob or fsspec URL)")
    inspect.add_argument("--tokenizer", help="a tokenizer.json, or a folder holding one "
                         "(default: a BPE trained on a sample of the data)")
    inspect.add_argument("--seq-len", type=_POSITIVE, default=2048,
                         help="model sequence length; rows are one token longer, for labels")
    inspect.add_argument("--batches", type=_POSITIVE, default=3, help="batches to show")
    inspect.add_argument("--batch-size", type=_POSITIVE, default=8, help="rows per batch")
    inspect.add_argument("--field", default="text", help="the text field of each record")
    inspect.add_argument("--format", default="auto", choices=["auto", *_formats()],
                         help="the files' format; auto reads it from the extension")
    inspect.add_argument("--num-lanes", type=_POSITIVE, default=8, help="lanes of the pipeline")
    inspect.add_argument("--chunk-size", type=_POSITIVE, default=512,
                         help="samples a lane reads at a time")
    inspect.add_argument("--shuffle-buffer", type=_at_least(2), default=_SHUFFLE_BUFFER,
                         help="buffer of the shuffle stage, in packed rows over all lanes")
    inspect.add_argument("--seed", type=int, default=0, help="seed of the read order")
    inspect.add_argument("--docs-shown", type=_COUNT, default=2, help="documents shown per batch")
    inspect.add_argument("--runner", default="threads", choices=runners,
                         help="where the stages run (the output is the same with each)")
    inspect.add_argument("--num-workers", type=_COUNT, default=2,
                         help="threads or processes of the runner")

    commands.add_parser(
        "bench", add_help=False, help="run a benchmark of a source checkout "
        "(bench [NAME] [ARGS...]; NAME defaults to pipeline)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zephon-torch``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after it belongs to the benchmark
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return _demo(args) if args.command == "demo" else _inspect(args)
    except BrokenPipeError:  # `zephon-torch inspect ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail
        return 0


if __name__ == "__main__":
    sys.exit(main())
