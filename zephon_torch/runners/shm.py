"""Shared-memory transport for the process runner and the DataLoader's engine.

What crosses between processes is pickled in a single call with protocol 5,
large buffers (numpy arrays: a block's identity columns, token offsets and
values) kept out of band. The result is written once into a file of a
RAM-backed file system (``/dev/shm``), a *segment*, and only a small
:class:`BlockRef` (the file name and the offsets) crosses the pipes::

    segment zephon-<owner pid>-<pid ns>-<pool token>-<creator pid>-<seq>
    ┌───────────────┬─pad─┬────────────┬─pad─┬────────────┐
    │ pickle stream │     │  buffer 0  │     │  buffer 1  │ ...
    └───────────────┴─────┴────────────┴─────┴────────────┘
    0               stream  buffers[0]         buffers[1]     (64-byte aligned)

    BlockRef(count=1, size=..., stream=1830,
             buffers=((1856, 8192), (10048, 8192), ...), name="zephon-4242-...-17")

Something whose total size is at most the writer's ``inline_limit`` carries
its bytes inside the ref instead, which spares the file system a create and
an unlink for a few hundred bytes; so does everything when the segment file
system is full (``ENOSPC`` from ``write``, never a ``SIGBUS`` from a mapped
page, which is why segments are written with ``pwrite`` and not through a
mapping).

Reading, and why the two sides differ:

* a **worker** maps the segment copy-on-write: numpy arrays are zero-copy
  views, only the pages an operator touches are read, and an operator that
  writes into its input arrays cannot change what a retry of the micro-batch
  would read. The mapping lives as long as the arrays do, the duration of
  one task;
* the **main process** copies each buffer once into memory of its own and
  unlinks the segment at once (:func:`unlink_ref`). What it reads goes on to
  shuffle buffers, prefetch queues and tensors made with
  ``torch.from_numpy``: zero-copy views would pin the segment in
  ``/dev/shm``, a small ``tmpfs`` in most containers, for as long as any one
  array lives. One ``memcpy`` is cheap next to the work that produced it.

A task's input segment is unlinked by the pool when the task is over (a
worker that dies mid-task leaves it for the retry); the pool sweeps its
prefix when it closes, and :func:`sweep_stale` removes the segments of
processes that died without any of that (``SIGKILL``). Segment names start
with the owning process's pid and pid namespace so that a sweep can tell
which owners are gone.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import pickle
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SEGMENT_PREFIX",
    "BlockRef",
    "Writer",
    "load",
    "new_prefix",
    "segment_dir",
    "sweep_prefix",
    "sweep_stale",
    "unlink_ref",
]

#: Every segment's file name starts with this.
SEGMENT_PREFIX = "zephon-"
_ALIGN = 64  # cache-line (and SIMD) alignment of every out-of-band buffer


# --------------------------------------------------------------------------- naming


def segment_dir() -> str:
    """Where segments live: ``$ZEPHON_SHM_DIR``, else ``/dev/shm``, else the temp dir.

    The temp-dir fallback (macOS has no ``/dev/shm``) is correct but goes
    through the page cache of a real file system.
    """
    configured = os.environ.get("ZEPHON_SHM_DIR")
    if configured:
        return configured
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _pid_namespace() -> str:
    # Containers sharing /dev/shm may not share a pid namespace: a pid that looks
    # dead from here may be alive over there, so sweeps only judge their own namespace.
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def new_prefix() -> str:
    """A fresh per-pool prefix: ``zephon-<pid>-<pid namespace>-<random token>``."""
    return f"{SEGMENT_PREFIX}{os.getpid()}-{_pid_namespace()}-{uuid.uuid4().hex[:12]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but someone else's
        return True
    return True


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def sweep_stale(directory: str) -> list[str]:
    """Remove segments whose owning process no longer exists; return their names.

    Only files of this user and of this pid namespace are judged.
    """
    namespace = _pid_namespace()
    uid = os.getuid()
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(SEGMENT_PREFIX):
            continue
        fields = entry.name[len(SEGMENT_PREFIX):].split("-")
        if len(fields) < 3 or not fields[0].isdigit() or fields[1] != namespace:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if not _pid_alive(int(fields[0])):
            _unlink(entry.path)
            removed.append(entry.name)
    return removed


def sweep_prefix(directory: str, prefix: str, keep: set[str] | frozenset[str] = frozenset()
                 ) -> list[str]:
    """Remove every segment whose name starts with ``prefix`` except those in ``keep``."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix) and name not in keep:
            _unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True, slots=True)
class BlockRef:
    """What crosses a pipe for one pickled list of objects (see the module doc).

    Attributes:
        count: Number of objects in the list.
        size: Total size in bytes.
        stream: Length of the pickle stream at offset 0.
        buffers: ``(offset, length)`` of each out-of-band buffer, in pickling order.
        name: Segment file name, or None when the bytes travel in ``data``.
        data: The block's bytes, for blocks that are not in a segment.
    """

    count: int
    size: int
    stream: int
    buffers: tuple[tuple[int, int], ...]
    name: str | None = None
    data: bytes | None = None


def _align(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


class Writer:
    """Writes blocks of payloads as segments named ``<prefix>-<seq>``.

    Args:
        directory: Where segments go (:func:`segment_dir`).
        prefix: Name prefix; it must start with the owning pool's prefix and
            end with the creating pid, so that sweeps can find orphans.
        inline_limit: Blocks of at most this many bytes travel inside the ref.
    """

    def __init__(self, directory: str, prefix: str, inline_limit: int) -> None:
        self.directory = directory
        self.prefix = prefix
        self.inline_limit = inline_limit
        self._seq = itertools.count()
        self._warned = False

    def dump(self, payloads: list[Any]) -> BlockRef:
        """Pickle ``payloads`` in one call and write them out (see the module doc)."""
        views: list[memoryview] = []

        # The callback returning None keeps each buffer out of band; numpy only
        # offers contiguous buffers, so raw() gives their bytes without a copy.
        def keep(buf: pickle.PickleBuffer) -> None:
            views.append(buf.raw())

        stream = pickle.dumps(payloads, protocol=5, buffer_callback=keep)
        layout = []
        end = len(stream)
        for view in views:
            start = _align(end)
            layout.append((start, view.nbytes))
            end = start + view.nbytes
        ref = BlockRef(count=len(payloads), size=end, stream=len(stream), buffers=tuple(layout))
        if end > self.inline_limit:
            name = f"{self.prefix}-{next(self._seq)}"
            try:
                self._write(os.path.join(self.directory, name), stream, views, layout, end)
            except OSError as exc:  # full or unusable file system: the pipe still works
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"zephon: cannot write shared-memory segments in {self.directory} "
                        f"({exc}); payloads go through the pipe instead (slower). Free space "
                        "there or set ZEPHON_SHM_DIR to a larger RAM-backed directory.",
                        RuntimeWarning, stacklevel=2,
                    )
            else:
                return BlockRef(ref.count, ref.size, ref.stream, ref.buffers, name=name)
        data = bytearray(end)
        data[:len(stream)] = stream
        for (start, length), view in zip(layout, views):
            data[start:start + length] = view
        return BlockRef(ref.count, ref.size, ref.stream, ref.buffers, data=bytes(data))

    @staticmethod
    def _write(path: str, stream: bytes, views: list[memoryview],
               layout: list[tuple[int, int]], size: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o600)
        try:
            os.ftruncate(fd, size)  # padding stays a hole: nothing to write there
            _pwrite_all(fd, memoryview(stream), 0)
            for (start, _), view in zip(layout, views):
                _pwrite_all(fd, view, start)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)

    def discard(self, ref: BlockRef | None) -> None:
        """Unlink the segment of a block that will never be delivered."""
        if ref is not None and ref.name is not None:
            _unlink(os.path.join(self.directory, ref.name))


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    total = view.nbytes
    while done < total:
        done += os.pwrite(fd, view[done:], offset + done)


# --------------------------------------------------------------------------- reading


def load(ref: BlockRef, directory: str, *, copy: bool) -> list[Any]:
    """The objects of a ref.

    Args:
        ref: What :meth:`Writer.dump` returned.
        directory: Where its segment lives.
        copy: True: every buffer is copied once into memory of its own (the
            main process). False: the segment is mapped copy-on-write and
            arrays are views into it (workers). See the module doc.

    Raises:
        FileNotFoundError: The segment is gone.
    """
    if ref.data is not None:
        # Inline bytes are small: copying keeps arrays writable, as from a segment.
        data = memoryview(ref.data)
        buffers: list[Any] = [bytearray(data[o:o + n]) for o, n in ref.buffers]
        return pickle.loads(data[:ref.stream], buffers=buffers)
    path = os.path.join(directory, ref.name or "")
    if copy:
        with open(path, "rb", buffering=0) as file:
            stream = _read_at(file, 0, ref.stream)
            buffers = [_read_at(file, o, n) for o, n in ref.buffers]
        return pickle.loads(stream, buffers=buffers)
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), ref.size, access=mmap.ACCESS_COPY)
    # The arrays keep views of the mapping; it is unmapped when the last one dies.
    view = memoryview(mapping)
    return pickle.loads(view[:ref.stream], buffers=[view[o:o + n] for o, n in ref.buffers])


def unlink_ref(ref: BlockRef | None, directory: str) -> None:
    """Remove the segment of a ref (nothing to do for inline bytes, or if already gone)."""
    if ref is not None and ref.name is not None:
        _unlink(os.path.join(directory, ref.name))


def _read_at(file: Any, offset: int, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    file.seek(offset)
    done = 0
    while done < size:
        got = file.readinto(view[done:])
        if not got:
            raise EOFError(f"shared-memory segment {file.name} is shorter than its ref says")
        done += got
    return buf
