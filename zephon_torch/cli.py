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

This module parses and checks the arguments and dispatches; each command is
a module of its own: ``_cli_demo.py``, ``_cli_inspect.py`` (whose format list
is the source format registry's) and ``_cli_bench.py``, with what ``demo``
and ``inspect`` share (the canonical pipeline, one batch shown) in
``_cli_show.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from zephon_torch._cli_bench import _bench
from zephon_torch._cli_demo import _demo
from zephon_torch._cli_inspect import _SHUFFLE_BUFFER, _formats, _inspect

__all__ = ["main"]


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
