"""``zephon-torch inspect``: a few batches of the user's own files through the canonical
pipeline, and one clear line for each problem with the input.

The formats it reads, and their names for ``--format``, are the source format
registry's (``sources/formats/registry.py``). Part of the ``zephon-torch``
command (``cli.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zephon_torch._cli_show import _canonical, _show_batch
from zephon_torch.pipeline import Pipeline
from zephon_torch.sources.formats.registry import CommandLineFormat, command_line_formats

#: ``inspect --shuffle-buffer``'s default.
_SHUFFLE_BUFFER = 1024


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
