"""The Ray pool: ``process_many`` of remote stages on Ray actors.

A stage added with ``placement="remote"`` (or ``placement=Remote(...)``)
keeps its accumulator on the driver thread, like every stage; only its
micro-batches go to Ray, and the results come back through the engine's
reorder buffer, so the output is the same as inline, byte for byte::

    driver thread (engine)           dispatcher thread              Ray actor k of the stage
    ──────────────────────           ─────────────────              ────────────────────────
    submit(stage, micro-batch)
      queued on the driver while
      max_in_flight are out
      ray.put((shape, metas as       ◄── a slot frees up:
        field tuples, payloads))         dispatch the next one
      actor.run.remote(ref) ─────────────────────────────────────► op.process_many (setup ran
                                                                     once, when the actor started)
                                                                   payloads pickled with
                                     reply ◄── object store ◄───── protocol 5, arrays out of band
                                     arrays copied once into
                                     memory of our own, records
                                     rebuilt, future.set_result

**Actors, not tasks.** Each remote stage has a pool of actors (the
:class:`~zephon_torch.ops.placement.Remote` options say how many and with
what resources). An actor receives the operator once, runs ``setup(ctx)``
once (a tokenizer, a classifier model, a GPU context), then serves any
number of micro-batches; a Ray task would pay for the setup (or a cache
lookup and a fetch of the operator) on every micro-batch. Actors also make
resource requests explicit (``num_cpus``, ``num_gpus``, custom resources).
Micro-batches go to the actor with the fewest outstanding ones.

**Payloads.** A micro-batch travels as one object: its metas packed as
field tuples (as for the process runner) and its payloads as one list, so
numpy arrays are written once into the object store and mapped zero-copy
(read-only) by the actor. The reply is the payload list pickled with
protocol 5 and its large buffers kept out of band, as numpy byte arrays the
object store carries zero-copy too; the driver copies each buffer once into
memory of its own, so the arrays it hands on are ordinary, writable and
never pin the object store while a shuffle buffer or a trainer keeps them.

**Backpressure.** At most ``max_in_flight`` micro-batches of a stage are in
Ray at once (default: twice the actors); the others wait as Python objects
on the driver, and the engine stops pulling input for the stage at the same
bound, so a fast source cannot flood the object store.

**Faults.** Actors are created with ``max_restarts=-1`` and
``max_task_retries=Remote.max_retries``: when an actor's process or node is
lost, Ray restarts the actor (running ``setup`` again) and sends its
unfinished micro-batches again, which is safe because ``process_many`` is
stateless. A micro-batch still failing after that becomes a
``RuntimeError`` naming the stage. An exception raised by the operator is
caught in the actor and re-raised in the consumer with its own type and
message (the actor's traceback attached as ``__cause__``); it is never
retried. An exception in ``setup`` is reported the same way, by the first
micro-batch of the stage.

**Connection.** A running Ray is used when ``ray.is_initialized()`` or
``RAY_ADDRESS`` is set; otherwise a local instance is started with
``ZEPHON_RAY_NUM_CPUS`` CPUs (default: the machine's), no dashboard, and the
driver's ``sys.path`` as the workers' ``PYTHONPATH`` (so that they import the
same modules, as spawned worker processes do). It
stays up for later iterators of the same process and is shut down at
interpreter exit or by :func:`shutdown`; zephon never shuts down a Ray it
did not start.

**Shutdown.** :meth:`RayPool.close` (idempotent; also run when the pool is
garbage-collected) fails pending futures, kills every actor of the pool
(``no_restart=True``) and drops every object reference it holds.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import pickle
import queue
import sys
import threading
import traceback
import uuid
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.block import Block
from zephon_torch.ops.base import OpContext, Operator, check_elements
from zephon_torch.ops.placement import Remote, placement_options
from zephon_torch.runners.base import Pool, run_unit
from zephon_torch.runners.wire import error_message, remote_error

__all__ = ["RayPool", "StageActor", "connect", "shutdown", "started_by_zephon"]

_PROTOCOL = 5
_CONNECT_LOCK = threading.Lock()
_STARTED = False


# --------------------------------------------------------------------------- connection


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "placement='remote' runs stages on Ray, which is not installed; install it with "
            "pip install 'zephon-torch[ray]'"
        ) from exc
    return ray


def connect() -> Any:
    """Make sure this process is connected to Ray; return the ``ray`` module.

    A running connection is kept (``ray.is_initialized()``); with
    ``RAY_ADDRESS`` set, Ray connects to that cluster; otherwise a local
    instance is started with ``ZEPHON_RAY_NUM_CPUS`` CPUs (default: all of
    this machine's) and no dashboard.
    """
    global _STARTED
    ray = _import_ray()
    with _CONNECT_LOCK:
        if ray.is_initialized():
            return ray
        if os.environ.get("RAY_ADDRESS"):
            # ray.init reads RAY_ADDRESS itself; the cluster is not ours to stop.
            ray.init()
            return ray
        raw = os.environ.get("ZEPHON_RAY_NUM_CPUS")
        try:
            num_cpus = int(raw) if raw else (os.cpu_count() or 1)
        except ValueError:
            raise ValueError(
                f"ZEPHON_RAY_NUM_CPUS must be a positive integer, got {raw!r}"
            ) from None
        if num_cpus < 1:
            raise ValueError(f"ZEPHON_RAY_NUM_CPUS must be a positive integer, got {raw!r}")
        # Workers import what the driver imports, as spawned worker processes do.
        paths = [p for p in (os.getcwd(), *sys.path) if p and os.path.isdir(p)]
        extra = os.environ.get("PYTHONPATH")
        env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(
            [*paths, *(extra.split(os.pathsep) if extra else [])]))}
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
        _STARTED = True
        return ray


def started_by_zephon() -> bool:
    """Whether the Ray this process uses is a local instance zephon started."""
    return _STARTED


def shutdown() -> None:
    """Stop the local Ray instance zephon started, if any (a no-op otherwise)."""
    global _STARTED
    with _CONNECT_LOCK:
        if not _STARTED:
            return
        _STARTED = False
        ray = _import_ray()
        if ray.is_initialized():
            ray.shutdown()


# --------------------------------------------------------------------------- payloads


def _dump_payloads(payloads: list[Any]) -> tuple[bytes, list[np.ndarray]]:
    """One pickle stream, large buffers out of band as numpy byte arrays."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(payloads, protocol=_PROTOCOL, buffer_callback=buffers.append)
    return stream, [np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers]


def _load_payloads(stream: bytes, buffers: Sequence[np.ndarray]) -> list[Any]:
    """Payloads from :func:`_dump_payloads`, each buffer copied into memory of our own."""
    return pickle.loads(stream, buffers=[b.copy() for b in buffers])


# --------------------------------------------------------------------------- actor side


class StageActor:
    """Holds one remote stage's operator on a Ray worker (wrapped by ``ray.remote``).

    Args:
        op: The operator (``setup(ctx)`` runs here, once per actor start).
        ctx: Its context.
        slot: The actor's number within its stage (for messages).
    """

    def __init__(self, op: Operator, ctx: OpContext, slot: int) -> None:
        self._op = op
        self._name = ctx.stage_name or f"stage {ctx.stage_index}"
        self._slot = slot
        self._setup_error: bytes | None = None
        try:
            op.setup(ctx)
        except Exception as exc:
            # Reported by every micro-batch: the consumer sees the setup error's own
            # type instead of an actor that keeps dying.
            self._setup_error = error_message(
                "error", 0, exc,
                f"{self._where()} failed in op.setup(ctx) of stage {self._name!r}:",
            )

    def _where(self) -> str:
        return f"zephon Ray actor {self._slot} (pid {os.getpid()})"

    def pid(self) -> int:
        """The actor's process id (tests and diagnostics)."""
        return os.getpid()

    def run(self, unit: Any) -> tuple[Any, ...]:
        """One micro-batch (a block or a list); an error is returned, never raised."""
        if self._setup_error is not None:
            return ("error", self._setup_error)
        try:
            out = run_unit(self._op, unit)
            del unit
            if type(out) is not Block:
                out = check_elements(out, self._name)
            try:
                stream, buffers = _dump_payloads([out])
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise TypeError(
                    f"stage {self._name!r} returned an element that cannot be pickled for the "
                    f"trip back to the driver: {exc}"
                ) from exc
            return ("result", stream, buffers)
        except Exception as exc:
            header = f"Traceback of {self._where()}, stage {self._name!r}:"
            return ("error", error_message("error", 0, exc, header))


# --------------------------------------------------------------------------- driver side


class _Job:
    """One micro-batch: its input until dispatched, then its Ray references."""

    __slots__ = ("actor", "batch", "future", "input_ref", "ray_future", "ref", "stage")

    def __init__(self, stage: _StageActors, batch: Any,
                 future: cf.Future) -> None:
        self.stage = stage
        self.batch: Any = batch
        self.future = future
        self.actor = -1
        self.input_ref: Any = None
        self.ref: Any = None
        self.ray_future: cf.Future | None = None


class _StageActors:
    """The actors of one remote stage, its queue and its in-flight micro-batches."""

    def __init__(self, index: int, name: str, options: Remote, actors: list[Any]) -> None:
        self.index = index
        self.name = name
        self.options = options
        self.actors = actors
        self.load = [0] * len(actors)
        self.pending: deque[_Job] = deque()
        self.running: set[_Job] = set()
        self.max_in_flight = options.max_in_flight or 2 * len(actors)


class _Core:
    """Everything the pool owns, kept apart from it so that a finalizer can close it."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray
        self.lock = threading.Lock()
        self.stages: dict[int, _StageActors] = {}
        self.done: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.stopping = False
        self.op_refs: list[Any] = []
        self.thread = threading.Thread(target=self._serve, name="zephon-ray-dispatcher",
                                       daemon=True)

    # ------------------------------------------------------------------ dispatch

    def submit(self, stage: _StageActors, job: _Job) -> None:
        with self.lock:
            if self.stopping:
                _fail(job.future, RuntimeError(
                    f"zephon RayPool is closed; stage {stage.name!r} takes no more work"))
                return
            stage.pending.append(job)
            self._dispatch(stage)

    def _dispatch(self, stage: _StageActors) -> None:
        """Send queued micro-batches while the stage has room (call with the lock held)."""
        while stage.pending and len(stage.running) < stage.max_in_flight:
            job = stage.pending.popleft()
            if job.future.cancelled():
                continue
            k = min(range(len(stage.load)), key=stage.load.__getitem__)
            try:
                job.input_ref = self.ray.put(job.batch)
                job.batch = None
                job.ref = stage.actors[k].run.remote(job.input_ref)
                job.ray_future = job.ref.future()
            except Exception as exc:
                job.input_ref = job.ref = None
                _fail(job.future, RuntimeError(
                    f"stage {stage.name!r}: could not send a micro-batch to Ray: {exc}"))
                continue
            job.actor = k
            stage.load[k] += 1
            stage.running.add(job)
            job.ray_future.add_done_callback(lambda _f, job=job: self.done.put(job))

    def _serve(self) -> None:
        """The dispatcher thread: finish completed jobs, dispatch waiting ones."""
        while True:
            job = self.done.get()
            if job is None:
                return
            stage = job.stage
            with self.lock:
                if self.stopping:
                    return
                stage.running.discard(job)
                stage.load[job.actor] -= 1
            try:
                self._finish(job)
            finally:
                job.ref = job.input_ref = job.ray_future = None  # frees the objects
                with self.lock:
                    if not self.stopping:
                        self._dispatch(stage)

    def _finish(self, job: _Job) -> None:
        stage = job.stage
        ray_exceptions = self.ray.exceptions
        try:
            reply = job.ray_future.result()  # type: ignore[union-attr]
        except ray_exceptions.RayActorError as exc:
            error: BaseException = RuntimeError(
                f"stage {stage.name!r}: the Ray actor running a micro-batch was lost and the "
                f"micro-batch failed again after {stage.options.max_retries} retries "
                f"(Remote(max_retries=...)); the run stops here (a crash in native code, "
                f"the out-of-memory killer, or a node that keeps failing?): {exc}"
            )
            error.__cause__ = exc
            _fail(job.future, error)
            return
        except BaseException as exc:
            error = RuntimeError(f"stage {stage.name!r}: Ray failed to run a micro-batch: "
                                 f"{type(exc).__name__}: {exc}")
            error.__cause__ = exc
            _fail(job.future, error)
            return
        try:
            if reply[0] == "error":
                _, blob, type_name, message, text = pickle.loads(reply[1])[1:]
                _fail(job.future, remote_error(blob, type_name, message, text))
                return
            _, stream, buffers = reply
            result = _load_payloads(stream, buffers)[0]
        except Exception as exc:
            error = RuntimeError(f"stage {stage.name!r}: could not read a reply from Ray: "
                                 f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            _fail(job.future, error)
            return
        with contextlib.suppress(cf.InvalidStateError):
            job.future.set_result(result)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
            jobs = [job for s in self.stages.values() for job in (*s.pending, *s.running)]
            actors = [a for s in self.stages.values() for a in s.actors]
            for stage in self.stages.values():
                stage.pending.clear()
                stage.running.clear()
        for job in jobs:
            _fail(job.future, RuntimeError(
                f"zephon RayPool was closed before a micro-batch of stage {job.stage.name!r} "
                "finished"))
        ray = self.ray
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.done.put(None)
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)
        for job in jobs:
            job.batch = job.ref = job.input_ref = job.ray_future = None
        for stage in self.stages.values():
            stage.actors = []
        self.op_refs.clear()


def _fail(future: cf.Future, exc: BaseException) -> None:
    with contextlib.suppress(cf.InvalidStateError):  # cancelled or already done
        future.set_exception(exc)


def _needs(options: Remote) -> dict[str, float]:
    """What one actor of a stage reserves."""
    needs = {"CPU": float(options.num_cpus), "GPU": float(options.num_gpus)}
    needs.update({k: float(v) for k, v in options.resources.items()})
    return {k: v for k, v in needs.items() if v > 0}


class RayPool(Pool):
    """Runs the remote stages' ``process_many`` on Ray actors (see the module doc).

    Args:
        ops: The compiled plan's operators, by stage index.
        ctxs: Their contexts.
        stages: Indices of the stages placed on Ray.
        upstream: Unused (kept for callers that pass the local pool).

    Raises:
        ValueError: A stage asks for more of a resource than the local Ray
            instance zephon started has.
        ImportError: Ray is not installed.
    """

    def __init__(self, ops: Sequence[Operator], ctxs: Sequence[OpContext],
                 stages: Sequence[int], *, upstream: Pool | None = None) -> None:
        ray = connect()
        self._upstream = upstream
        self._core = core = _Core(ray)
        self._finalizer = weakref.finalize(self, core.shutdown)
        token = uuid.uuid4().hex[:8]
        chosen = {i: placement_options(ops[i]) or Remote() for i in stages}
        counts = self._actor_counts(ray, chosen, ctxs)
        actor_class = ray.remote(StageActor)
        try:
            for i, options in chosen.items():
                ctx = ctxs[i]
                name = ctx.stage_name or f"stage {i}"
                op_ref = ray.put(ops[i])  # shared by the stage's actors and their restarts
                core.op_refs.append(op_ref)
                actors = [
                    actor_class.options(
                        name=f"zephon-{token}-{name}-{k}",
                        num_cpus=options.num_cpus, num_gpus=options.num_gpus,
                        resources=dict(options.resources) or None,
                        max_restarts=-1, max_task_retries=options.max_retries,
                    ).remote(op_ref, ctx, k)
                    for k in range(counts[i])
                ]
                core.stages[i] = _StageActors(i, name, options, actors)
        except BaseException:
            core.shutdown()
            raise
        self._token = token
        core.thread.start()

    @staticmethod
    def _actor_counts(ray: Any, chosen: Mapping[int, Remote],
                      ctxs: Sequence[OpContext]) -> dict[int, int]:
        """Actors per stage: explicit, or an equal share of what is free now."""
        if _STARTED:  # our own local instance: a request it can never meet would hang
            total = ray.cluster_resources()
            for i, options in chosen.items():
                for resource, need in _needs(options).items():
                    have = float(total.get(resource, 0.0))
                    if need > have:
                        name = ctxs[i].stage_name or f"stage {i}"
                        raise ValueError(
                            f"stage {name!r}: each Ray actor asks for {resource}={need:g} but "
                            f"the local Ray instance has {have:g} in all; lower it in "
                            "Remote(...), set ZEPHON_RAY_NUM_CPUS, or connect to a cluster "
                            "(ray.init(address=...) or RAY_ADDRESS)"
                        )
        counts = {i: o.num_actors for i, o in chosen.items() if o.num_actors is not None}
        automatic = [i for i in chosen if i not in counts]
        if not automatic:
            return counts  # type: ignore[return-value]
        free = {k: float(v) for k, v in ray.available_resources().items()}
        for i, n in counts.items():
            for resource, need in _needs(chosen[i]).items():
                free[resource] = free.get(resource, 0.0) - n * need
        for i in automatic:
            needs = _needs(chosen[i]) or {"CPU": 1.0}
            share = [int(max(0.0, free.get(r, 0.0)) / len(automatic) // need)
                     for r, need in needs.items()]
            counts[i] = max(1, min(share))
        return counts  # type: ignore[return-value]

    # ------------------------------------------------------------------ the pool

    def submit(self, stage_index: int, elems: list[Any]) -> cf.Future:
        """Queue ``elems`` for the stage's actors; the future's result is local records."""
        future: cf.Future = cf.Future()
        stage = self._core.stages.get(stage_index)
        if stage is None:
            future.set_exception(IndexError(
                f"stage index {stage_index} is not a remote stage of this pool "
                f"(remote stages: {sorted(self._core.stages)})"))
            return future
        self._core.submit(stage, _Job(stage, elems, future))
        return future

    def close(self) -> None:
        """Fail pending futures, kill every actor, drop every reference; idempotent."""
        self._finalizer()

    # ------------------------------------------------------------------ diagnostics

    def max_in_flight(self, stage_index: int) -> int:
        """How many micro-batches of the stage may be in Ray at once."""
        return self._core.stages[stage_index].max_in_flight

    @property
    def stage_indices(self) -> list[int]:
        """The remote stages' indices."""
        return sorted(self._core.stages)

    def actor_names(self) -> dict[str, list[str]]:
        """``{stage name: [actor names]}`` (named actors in the job's namespace)."""
        return {s.name: [f"zephon-{self._token}-{s.name}-{k}" for k in range(len(s.load))]
                for s in self._core.stages.values()}

    def actor_pids(self, stage_name: str, timeout: float = 60.0) -> list[int]:
        """Process ids of a stage's actors (waits until they are up)."""
        ray = self._core.ray
        for stage in self._core.stages.values():
            if stage.name == stage_name:
                return list(ray.get([a.pid.remote() for a in stage.actors], timeout=timeout))
        raise KeyError(f"no remote stage named {stage_name!r}")

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
