"""Reading a file as a stream of blocks, decompressing ``.gz`` and ``.zst``.

:func:`iter_raw_blocks` yields a file's blocks and reports every byte it
reads with :func:`~zephon_torch.sources.base.count_read`
(``stats()["bytes_read"]``).

**Compressed streams.** ``.gz`` and ``.zst`` cannot be entered in the
middle; :func:`iter_decompressed` yields decompressed blocks and, unlike the
standard library's readers, notices a stream that stops before its end
marker (``zstandard``'s ``stream_reader`` silently returns fewer bytes), so a
truncated file is an error, or, when asked, the complete lines before the
cut. Counting (:class:`~zephon_torch.sources.lines.LineScanner`) and
streaming (:func:`~zephon_torch.sources.lines.iter_lines`) see the same
blocks and keep the same lines, so the two always agree.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from zephon_torch._extras import require
from zephon_torch.sources.base import count_read

__all__ = ["BLOCK_SIZE", "TruncatedStreamError", "iter_decompressed", "iter_raw_blocks"]

#: Bytes read (or decompressed) at a time when scanning or streaming a file.
BLOCK_SIZE = 1 << 20


class TruncatedStreamError(ValueError):
    """A compressed stream ended before its end marker, or is corrupt."""


def iter_raw_blocks(file: BinaryIO, block_size: int = BLOCK_SIZE) -> Iterator[bytes]:
    """Blocks of ``file`` until end of file."""
    while True:
        block = file.read(block_size)
        if not block:
            return
        count_read(len(block))
        yield block


def iter_decompressed(file: BinaryIO, compression: str | None, *,
                      block_size: int = BLOCK_SIZE) -> Iterator[bytes]:
    """Decompressed blocks of ``file`` (``compression``: None, "gzip" or "zstd").

    Concatenated gzip members and zstd frames are read one after another.

    Raises:
        TruncatedStreamError: The input ends inside a member/frame, or is not
            valid compressed data. Blocks before the fault have been yielded.
    """
    if compression is None:
        yield from iter_raw_blocks(file, block_size)
    elif compression == "gzip":
        yield from _iter_members(file, block_size, lambda: zlib.decompressobj(wbits=31),
                                 zlib.error)
    elif compression == "zstd":
        zstandard = require("zstandard", "reading .zst files")

        dctx = zstandard.ZstdDecompressor()
        yield from _iter_members(file, block_size, dctx.decompressobj, zstandard.ZstdError)
    else:
        raise ValueError(f"unknown compression {compression!r}")


def _iter_members(file: BinaryIO, block_size: int, new: Callable[[], Any],
                  error: type[Exception]) -> Iterator[bytes]:
    # A fresh decompressor per member/frame; the bytes after one's end marker
    # (``unused_data``) start the next. The input is fed in pieces small
    # enough that one piece cannot expand without bound in memory.
    piece = 64 << 10
    dobj = None  # None between members: only padding or a new member may follow
    for block in iter_raw_blocks(file, block_size):
        data = block
        while data:
            if dobj is None:
                data = data.lstrip(b"\x00")  # gzip tools may pad with zeros
                if not data:
                    break
                dobj = new()
            feed, data = data[:piece], data[piece:]
            try:
                out = dobj.decompress(feed)
            except error as exc:
                raise TruncatedStreamError(f"corrupt compressed data ({exc})") from exc
            if out:
                yield out
            if dobj.eof:
                data = dobj.unused_data + data
                dobj = None
    if dobj is not None:
        raise TruncatedStreamError("the compressed stream ends before its end marker "
                                   "(the file is truncated)")
