"""The one place that knows Lightning's private fit-loop structure.

A ``zephon_torch.DataLoader`` passed to ``Trainer.fit`` directly is saved by
Lightning itself: its fit loop calls the loader's ``state_dict()`` when it
builds a checkpoint, while its data fetcher already holds the batch after the
one the training step received. To answer with the position of that batch,
the loader asks :func:`fit_loop_view` how the fit loop stands with it.

Lightning offers no public way to get from a train loader to the trainer
that iterates it (the loader's methods are called without one), so this
module follows Lightning's fit loops themselves: :func:`follow_fit_loops`,
which the loader calls whenever it is iterated while Lightning is imported
(Lightning always iterates a train loader before its fit loop starts), wraps
three methods of the fit-loop class once per process:

* ``on_run_start``: the loop runs (recorded in a weak set);
* ``teardown``: it no longer does;
* ``on_save_checkpoint``: it is collecting its loaders' states for a checkpoint,
  which Lightning does on every rank (so a collective is safe there).

The rest is read from the loop when asked, with public attributes where
Lightning has them (``loop.trainer``, ``trainer.state.fn``,
``trainer.train_dataloader``) and these private names where it has none:
the class ``_FitLoop`` of ``lightning.pytorch.loops.fit_loop`` (or
``pytorch_lightning.loops.fit_loop``), its ``_combined_loader``
(``.flattened``) and ``_data_fetcher``, the fetcher classes
``_PrefetchDataFetcher`` (``.batches``: what it holds ahead of the step) and
``_DataLoaderIterDataFetcher`` (holds none), and the fetcher's ``done``.
They were tested with the releases in :data:`TESTED_LIGHTNING`; under
another release, or where one of them is missing or of another type, the
loader warns once (``RuntimeWarning``) that the position saved may be off by
the batches Lightning prefetched. ``ZephonDataModule`` relies on none of
this: its streams count batches through a public hook.

This module imports neither Lightning nor the loader: it reads the Lightning
modules already imported (``sys.modules``).
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["TESTED_LIGHTNING", "FitView", "fit_loop_view", "follow_fit_loops"]

_FIT_LOOP_MODULES = ("lightning.pytorch.loops.fit_loop", "pytorch_lightning.loops.fit_loop")
_FIT_LOOP_CLASS = "_FitLoop"
#: The Lightning releases whose fit loop :func:`fit_loop_view` was tested with (>= first,
#: < second); the "lightning" extra of pyproject.toml pins the same range.
TESTED_LIGHTNING = ((2, 2), (2, 7))

# Fit loops between on_run_start and teardown, and those inside on_save_checkpoint.
_RUNNING: weakref.WeakSet[Any] = weakref.WeakSet()
_SAVING: weakref.WeakSet[Any] = weakref.WeakSet()
# The fit-loop classes whose methods are wrapped, and the modules found without one.
_FOLLOWED: set[type] = set()
_UNFOLLOWED: set[str] = set()
# Warnings about Lightning given once per loader.
_WARNED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


class FitView(NamedTuple):
    """What Lightning's fit loop holds of a train loader, when ``state_dict()`` is called."""

    held: int  # batches its fetcher took from the loader but the step has not received
    epoch_over: bool  # the step has received the epoch's last batch
    saving: bool  # the call comes from the loop's checkpoint dump (on every rank)


def follow_fit_loops() -> None:
    """Start following the fit loops of every Lightning imported so far (once per class).

    Called by the loader each time it is iterated; it costs a dictionary
    look-up when there is nothing new to follow. Where a Lightning's fit-loop
    module has no ``_FitLoop`` class, it warns once per process.
    """
    for module_name in _FIT_LOOP_MODULES:
        module = sys.modules.get(module_name)
        if module is None or module_name in _UNFOLLOWED:
            continue
        cls = getattr(module, _FIT_LOOP_CLASS, None)
        if cls in _FOLLOWED:
            continue
        methods = ("on_run_start", "teardown", "on_save_checkpoint")
        if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in methods):
            _UNFOLLOWED.add(module_name)
            package = module_name.split(".")[0]
            warnings.warn(
                f"zephon DataLoader under {package} {_version(package)}: its fit loop is not one "
                f"this loader can read (no class {_FIT_LOOP_CLASS} with on_run_start, teardown "
                f"and on_save_checkpoint in {module_name}), so if Trainer.fit iterates a zephon "
                "DataLoader directly, the position saved in checkpoints may be off by the "
                "batch(es) Lightning prefetched (a resume would skip them). Use "
                "zephon_torch.lightning.ZephonDataModule, which counts batches through a "
                "public hook, instead of passing the loader to Trainer.fit directly",
                RuntimeWarning, stacklevel=3)
            continue
        _wrap(cls)
        _FOLLOWED.add(cls)


def _wrap(cls: type) -> None:
    """Wrap the three methods of the fit-loop class ``cls`` that say where the loop stands."""
    run_start: Callable[..., Any] = cls.on_run_start  # type: ignore[attr-defined]
    teardown: Callable[..., Any] = cls.teardown  # type: ignore[attr-defined]
    save: Callable[..., Any] = cls.on_save_checkpoint  # type: ignore[attr-defined]

    @functools.wraps(run_start)
    def on_run_start(self: Any, *args: Any, **kwargs: Any) -> Any:
        _RUNNING.add(self)
        return run_start(self, *args, **kwargs)

    @functools.wraps(teardown)
    def on_teardown(self: Any, *args: Any, **kwargs: Any) -> Any:
        _RUNNING.discard(self)
        return teardown(self, *args, **kwargs)

    @functools.wraps(save)
    def on_save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        _SAVING.add(self)
        try:
            return save(self, *args, **kwargs)
        finally:
            _SAVING.discard(self)

    cls.on_run_start = on_run_start  # type: ignore[attr-defined]
    cls.teardown = on_teardown  # type: ignore[attr-defined]
    cls.on_save_checkpoint = on_save_checkpoint  # type: ignore[attr-defined]


def fit_loop_view(loader: object) -> FitView | None:
    """How Lightning's fit loop stands with ``loader``, when it iterates it (else ``None``).

    Lightning's fit loop saves its train loaders' ``state_dict()`` in a
    checkpoint (``on_save_checkpoint``), while its ``_PrefetchDataFetcher``
    already holds the batch after the one the training step received, in
    ``fetcher.batches``; a ``training_step(dataloader_iter)`` gets a
    ``_DataLoaderIterDataFetcher``, which holds none. ``fetcher.done`` says
    that the step has received the epoch's last batch: Lightning's next epoch
    starts a new iteration. Only a running fit loop (see the module doc)
    that has ``loader`` itself among its train loaders counts (not, say, the
    loader inside a ``ZephonDataModule`` stream, which counts for itself).

    ``saving`` is true inside the loop's ``on_save_checkpoint``:
    ``Trainer.save_checkpoint`` builds the whole checkpoint on every rank,
    and only then lets rank 0 write it, so a collective is safe there. A
    call from elsewhere in the fit (a callback, the training step) may come
    from one rank only.

    Warnings name the caller of ``DataLoader.state_dict()``, which calls this.

    Args:
        loader: The loader whose ``state_dict()`` is being called.

    Returns:
        ``None`` when no running fit loop iterates ``loader``.
    """
    for loop in list(_RUNNING):
        module = str(type(loop).__module__)
        package = module.split(".")[0]
        if not _is_fit_loop(loop):
            # A fit loop whose class was renamed since this module started following it.
            _check_unrecognised_fit(loader, loop, package)
            continue
        view = _read_fit_loop(loader, loop, package, loop in _SAVING)
        if view is not None:
            return view
    return None


def _check_unrecognised_fit(loader: object, loop: Any, package: str) -> None:
    """Warn (once) when a ``Trainer.fit`` of ``loader`` runs a fit loop this module cannot read.

    The trainer is the loop's (``loop.trainer``); whether it fits with
    ``loader`` among its ``train_dataloader`` is read from public attributes.
    """
    trainer = getattr(loop, "trainer", None)
    if not _fits_with(trainer, loader, package):
        return
    _warn_lightning(loader, "structure", (
        f"zephon DataLoader under {package} {_version(package)}: Trainer.fit iterates this "
        f"loader, but its fit loop is not one this loader can read (its class is "
        f"{type(loop).__name__}, not a {_FIT_LOOP_CLASS} of " + " or ".join(_FIT_LOOP_MODULES)
        + "), so the position saved in checkpoints may be off by the batch(es) Lightning "
        "prefetched (a resume would skip them). Use zephon_torch.lightning.ZephonDataModule, "
        "which counts batches through a public hook, instead of passing the loader to "
        "Trainer.fit directly"), stacklevel=5)  # state_dict's caller


def _fits_with(trainer: Any, loader: object, package: str) -> bool:
    """Whether ``trainer`` is a Lightning ``Trainer`` fitting with ``loader`` as a train loader."""
    module = sys.modules.get("lightning.pytorch" if package == "lightning" else package)
    trainer_class = getattr(module, "Trainer", None)
    if trainer_class is None or not isinstance(trainer, trainer_class):
        return False
    try:
        fitting = str(getattr(trainer.state.fn, "value", trainer.state.fn)) == "fit"
        loaders = trainer.train_dataloader
    except Exception:  # a trainer of another shape: nothing to say about it
        return False
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    return fitting and any(dl is loader for dl in loaders)


def _read_fit_loop(loader: object, loop: Any, package: str, saving: bool) -> FitView | None:
    """:func:`fit_loop_view` of the fit loop ``loop`` (of the Lightning ``package``)."""
    version = _version(package)

    def unexpected(what: str) -> None:
        _warn_lightning(loader, "structure", (
            f"zephon DataLoader under Lightning {version}: its fit loop does not have the "
            f"structure this loader reads to count the batches Lightning's fetcher took ahead "
            f"of the training step ({what}), so the position saved in checkpoints may be off "
            "by the batch(es) Lightning prefetched (a resume would skip them). Use "
            "zephon_torch.lightning.ZephonDataModule, which counts batches through a public "
            "hook, instead of passing the loader to Trainer.fit directly"
        ), stacklevel=6)  # state_dict's caller: above fit_loop_view, _read_fit_loop, this

    if not hasattr(loop, "_combined_loader"):
        unexpected(f"{type(loop).__name__} has no '_combined_loader'")
        return None
    combined = loop._combined_loader
    if combined is None:
        return None  # no train loader set up yet: this loader is not one of them
    flattened = getattr(combined, "flattened", None)
    if not isinstance(flattened, (list, tuple)):
        unexpected(f"its combined loader ({type(combined).__name__}) has no 'flattened' list")
        return None
    if not any(dl is loader for dl in flattened):
        return None
    _check_lightning_version(loader, package, version)
    if not hasattr(loop, "_data_fetcher"):
        unexpected(f"{type(loop).__name__} has no '_data_fetcher'")
        return FitView(0, False, saving)
    fetcher = loop._data_fetcher
    if fetcher is None:
        return FitView(0, False, saving)  # between fits: nothing is held
    kinds = {cls.__name__ for cls in type(fetcher).__mro__}
    done = getattr(fetcher, "done", None)
    if not isinstance(done, bool):
        unexpected(f"{type(fetcher).__name__}.done is {type(done).__name__}, not a bool")
        done = False
    batches = getattr(fetcher, "batches", None)
    if "_DataLoaderIterDataFetcher" in kinds:
        held = 0  # the step pulls its batches itself: none is held ahead of it
    elif "_PrefetchDataFetcher" in kinds and isinstance(batches, list):
        held = len(batches)
    else:
        if "_PrefetchDataFetcher" in kinds:
            unexpected(f"{type(fetcher).__name__}.batches is {type(batches).__name__}, not a "
                       "list")
        else:
            unexpected(f"an unknown data fetcher, {type(fetcher).__name__}")
        held = len(batches) if isinstance(batches, list) else 0
    return FitView(held, done, saving)


def _check_lightning_version(loader: object, package: str, version: str) -> None:
    """Warn (once per loader) when Lightning is not a release the fit-loop view was tested with."""
    match = re.match(r"(\d+)\.(\d+)", version)
    low, high = TESTED_LIGHTNING
    if match is not None and low <= (int(match[1]), int(match[2])) < high:
        return
    tested = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    _warn_lightning(loader, "version", (
        f"zephon DataLoader under {package} {version}: to save the position of the batch the "
        f"training step received, this loader reads private parts of Lightning's fit loop, "
        f"tested with lightning{tested}; with another release the position saved in "
        "checkpoints may be off by the batch(es) Lightning prefetched. Use "
        "zephon_torch.lightning.ZephonDataModule, which relies on a public hook only, or a "
        f"tested Lightning (pip install 'lightning{tested}')"
    ), stacklevel=6)  # state_dict's caller: above fit_loop_view, _read_fit_loop, this


def _warn_lightning(loader: object, key: str, message: str, stacklevel: int) -> None:
    """Warn once per loader and ``key``; ``stacklevel`` counts from this function, and names
    the caller of ``DataLoader.state_dict()``."""
    given = _WARNED.setdefault(loader, set())
    if key in given:
        return
    given.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _version(package: str) -> str:
    return str(getattr(sys.modules.get(package), "__version__", "of unknown version"))


def _is_fit_loop(obj: object) -> bool:
    return any(cls.__name__ == _FIT_LOOP_CLASS and cls.__module__ in _FIT_LOOP_MODULES
               for cls in type(obj).__mro__)
