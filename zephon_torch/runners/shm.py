"""Shared-memory transport for the process runner.

The payloads of one micro-batch travel as one *block*: the list of payloads
pickled in a single call with protocol 5, large buffers (numpy arrays,
bytearrays) kept out of band. The block is written once into a file of a
RAM-backed file system (``/dev/shm``), a *segment*, and only a small
:class:`BlockRef` (the file name and the offsets) crosses the pipes::

    segment zephon-<owner pid>-<pid ns>-<pool token>-<creator pid>-<seq>
    ┌───────────────┬─pad─┬────────────┬─pad─┬────────────┐
    │ pickle stream │     │  buffer 0  │     │  buffer 1  │ ...
    └───────────────┴─────┴────────────┴─────┴────────────┘
    0               stream  buffers[0]         buffers[1]     (64-byte aligned)

    BlockRef(count=64, size=..., stream=1830,
             buffers=((1856, 8192), (10048, 8192), ...), name="zephon-4242-...-17")

A block whose total size is at most the writer's ``inline_limit`` (a few
small records) carries its bytes inside the ref instead, which spares
the file system a create and an unlink for a few hundred bytes; so does every
block when the segment file system is full (``ENOSPC`` from ``write``, never a
``SIGBUS`` from a mapped page, which is why segments are written with
``pwrite`` and not through a mapping).

Reading, and why the two sides differ:

* a **worker** maps the segment copy-on-write: numpy arrays are zero-copy
  views, only the pages an operator touches are read (a micro-batch may use a
  few records of a bigger upstream block), and an operator that writes into
  its input arrays cannot change what a retry of the micro-batch would read.
  The mapping lives as long as the arrays do, which is the duration of one
  ``process_many`` call;
* the **main process** (:meth:`Block.payloads`) copies each buffer once into
  memory of its own. Payloads resolved here go to the trainer and may be
  kept for long (a shuffle buffer, a prefetch queue, a tensor made with
  ``torch.from_numpy``): zero-copy views would pin the whole micro-batch's
  segment in ``/dev/shm``, a small ``tmpfs`` in most containers, for as long
  as any one array lives. One ``memcpy`` is cheap next to the work that
  produced the payload, and the arrays come back ordinary: independently
  owned, and writable exactly when the worker's were.

Lifetime in the main process: a :class:`Block` owns its segment; every
:class:`LazyPayload` ``(block, index)`` and every task that forwards the
block to a worker keeps it alive. When the last of them is gone (usually
right after its records are resolved), a ``weakref.finalize`` unlinks the
file. Reading a block does not unlink it: records of one block may take
different paths (a tombstone that carries a payload skips the accumulators
and can be resolved at a later stage while its siblings still wait for a
worker, holding handles to the same block). The pool's :class:`Ledger` unlinks
whatever is left when the pool closes, finalizers run at interpreter exit,
and :func:`sweep_stale` removes the segments of processes that died without
any of that (``SIGKILL``). Segment names start with the owning process's pid
and pid namespace so that a sweep can tell which owners are gone. Only the
process that created a ledger ever unlinks through it: a child forked later
(a DataLoader worker) inherits the blocks and their finalizers, and must not
delete the parent's segments when it collects them.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import mmap
import os
import pickle
import tempfile
import threading
import uuid
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "SEGMENT_PREFIX",
    "Block",
    "BlockRef",
    "LazyPayload",
    "Ledger",
    "Writer",
    "decode_counts",
    "describe",
    "load",
    "new_prefix",
    "segment_dir",
    "sweep_prefix",
    "sweep_stale",
]

#: Every segment's file name starts with this.
SEGMENT_PREFIX = "zephon-"
_ALIGN = 64  # cache-line (and SIMD) alignment of every out-of-band buffer
# Main-process reads of blocks, by tag (the stage that produced the block): lets
# tests check that payloads flowing between two process stages are never read here.
_DECODES: Counter[Any] = Counter()


def decode_counts() -> dict[Any, int]:
    """How many blocks this process has read through :meth:`Block.payloads`, by tag."""
    return dict(_DECODES)


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
    """What crosses a pipe for one block of payloads (see the module doc).

    Attributes:
        count: Number of payloads in the block.
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

    def dump(self, payloads: list[Any],
             persistent_id: Callable[[Any], Any] | None = None) -> BlockRef:
        """Pickle ``payloads`` in one call and write them out (see the module doc).

        ``persistent_id``, if given, is the pickler's hook: an object for
        which it returns something other than None is stored as that
        reference (the reader's ``persistent_load`` turns it back), which is
        how handles nested inside a payload travel without their data.
        """
        views: list[memoryview] = []

        # The callback returning None keeps each buffer out of band; numpy only
        # offers contiguous buffers, so raw() gives their bytes without a copy.
        def keep(buf: pickle.PickleBuffer) -> None:
            views.append(buf.raw())

        if persistent_id is None:
            stream = pickle.dumps(payloads, protocol=5, buffer_callback=keep)
        else:
            out = io.BytesIO()
            pickler = pickle.Pickler(out, protocol=5, buffer_callback=keep)
            pickler.persistent_id = persistent_id  # type: ignore[method-assign]
            pickler.dump(payloads)
            stream = out.getvalue()
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


def load(ref: BlockRef, directory: str, *, copy: bool,
         persistent_load: Callable[[Any], Any] | None = None) -> list[Any]:
    """The payloads of a block.

    Args:
        ref: The block.
        directory: Where its segment lives.
        copy: True: every buffer is copied once into memory of its own (the
            main process). False: the segment is mapped copy-on-write and
            arrays are views into it (workers). See the module doc.
        persistent_load: Turns the references that the writer's
            ``persistent_id`` stored back into objects.

    Raises:
        FileNotFoundError: The segment is gone.
    """
    if ref.data is not None:
        # Inline blocks are small: copying keeps arrays writable, as from a segment.
        data = memoryview(ref.data)
        buffers: list[Any] = [bytearray(data[o:o + n]) for o, n in ref.buffers]
        return _unpickle(data[:ref.stream], buffers, persistent_load)
    path = os.path.join(directory, ref.name or "")
    if copy:
        with open(path, "rb", buffering=0) as file:
            stream = _read_at(file, 0, ref.stream)
            buffers = [_read_at(file, o, n) for o, n in ref.buffers]
        return _unpickle(stream, buffers, persistent_load)
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), ref.size, access=mmap.ACCESS_COPY)
    # The arrays keep views of the mapping; it is unmapped when the last one dies.
    view = memoryview(mapping)
    return _unpickle(view[:ref.stream], [view[o:o + n] for o, n in ref.buffers],
                     persistent_load)


def _unpickle(stream: Any, buffers: list[Any],
              persistent_load: Callable[[Any], Any] | None) -> list[Any]:
    if persistent_load is None:
        return pickle.loads(stream, buffers=buffers)
    unpickler = pickle.Unpickler(io.BytesIO(stream), buffers=buffers)
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    return unpickler.load()


def describe(payload: Any) -> dict[str, int] | None:
    """What a consumer may learn of a payload without reading it: for a dict,
    each field's length if it is a 1-D integer array, else -1; None otherwise.

    Workers compute it for every payload they return, so that the main
    process can pack documents it never reads (see :class:`LazyPayload`).
    """
    if type(payload) is not dict:
        return None
    return {key: value.shape[0] if type(value) is np.ndarray and value.ndim == 1
            and value.dtype.kind in "iu" else -1 for key, value in payload.items()}


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


# --------------------------------------------------------------------------- ownership


class Ledger:
    """The segments a pool owns in the main process.

    A :class:`Block` registers its segment here; the block's finalizer
    releases it, and :meth:`release_all` unlinks the rest when the pool
    closes. After that, adopted segments are unlinked at once.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._owner = os.getpid()
        self._names: set[str] = set()
        # Re-entrant: a garbage collection inside a locked section may run a
        # block finalizer that releases another segment on the same thread.
        self._lock = threading.RLock()
        self._closed = False

    def adopt(self, name: str) -> bool:
        """Take ownership of a segment; False (and unlinked) if the ledger is closed."""
        with self._lock:
            if not self._closed:
                self._names.add(name)
                return True
        _unlink(os.path.join(self.directory, name))
        return False

    def release(self, name: str) -> None:
        """Unlink one segment (a no-op in a forked child: see the module doc)."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            self._names.discard(name)
        _unlink(os.path.join(self.directory, name))

    def names(self) -> frozenset[str]:
        """The segments owned now."""
        with self._lock:
            return frozenset(self._names)

    def release_all(self) -> None:
        """Unlink every owned segment and refuse new ones."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            self._closed = True
            names, self._names = self._names, set()
        for name in names:
            _unlink(os.path.join(self.directory, name))


class Block:
    """A block of payloads owned by the main process (see the module doc).

    Args:
        ref: The block's ref.
        ledger: The owning pool's ledger.
        tag: Free-form label for :func:`decode_counts` (the producing stage).
    """

    __slots__ = ("__weakref__", "_finalizer", "_lock", "_payloads", "ledger", "ref", "tag")

    def __init__(self, ref: BlockRef, ledger: Ledger, tag: Any = None) -> None:
        self.ref = ref
        self.ledger = ledger
        self.tag = tag
        self._payloads: list[Any] | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None
        if ref.name is not None and ledger.adopt(ref.name):
            self._finalizer = weakref.finalize(self, ledger.release, ref.name)

    @property
    def forwardable(self) -> bool:
        """Whether a worker can still read the block through its ref."""
        if self.ref.name is None:
            return True
        return self._finalizer is not None and self._finalizer.alive

    def payloads(self) -> list[Any]:
        """All payloads, read once (copied) and cached.

        Raises:
            RuntimeError: The segment is gone (its pool was closed first).
        """
        with self._lock:
            if self._payloads is None:
                try:
                    self._payloads = load(self.ref, self.ledger.directory, copy=True)
                except FileNotFoundError as exc:
                    raise RuntimeError(
                        f"shared-memory segment {self.ref.name} is gone: the ProcessPool "
                        "that produced this payload was closed before it was resolved"
                    ) from exc
                _DECODES[self.tag] += 1
            return self._payloads

    def __repr__(self) -> str:
        where = self.ref.name if self.ref.name is not None else f"{self.ref.size} inline bytes"
        return f"Block({where}, count={self.ref.count})"


class LazyPayload:
    """A payload still in shared memory: payload ``index`` of ``block``.

    Records leaving a process stage carry these; the pool's ``resolve``
    replaces them with real payloads, and a later process stage receives the
    ref without the main process reading anything, also when the handle is
    nested inside another payload (a packer's bin plan lists its documents
    as handles). ``info`` is :func:`describe` of the payload, computed by
    the worker that made it (None if not known), so that a packer can place
    a document by its length without reading it.
    """

    __slots__ = ("block", "index", "info")

    def __init__(self, block: Block, index: int, info: dict[str, int] | None = None) -> None:
        self.block = block
        self.index = index
        self.info = info

    def load(self) -> Any:
        """The real payload (reads the whole block once, on first use)."""
        return self.block.payloads()[self.index]

    def __reduce__(self) -> Any:
        raise TypeError(
            "a LazyPayload (a payload still in zephon's shared memory) cannot be pickled; "
            "resolve it first with the pool's resolve() or LazyPayload.load()"
        )

    def __repr__(self) -> str:
        return f"LazyPayload({self.block!r}[{self.index}])"
