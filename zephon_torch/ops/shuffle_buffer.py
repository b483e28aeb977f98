"""The shuffle's buffer, shared by the lanes, and the states saved before it was.

``Shuffle(buffer_size)`` is the pipeline's whole buffer: each lane holds
:func:`lane_buffer_size` rows of it. Until that rule, each lane held the
whole ``buffer_size``; a shuffle's config then had no ``buffer_split`` entry
(:data:`BUFFER_SPLIT`), so a state saved then no longer matches the
fingerprint. Those states are the shuffle's to judge, through the
operator's hooks (:meth:`~zephon_torch.ops.base.Operator.earlier_config`,
:meth:`~zephon_torch.ops.base.Operator.refuse_earlier_state`):
:func:`unsplit_config` accepts one whose order this pipeline's shuffle
gives exactly, and :func:`refuse_unsplit` words the refusal of the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zephon_torch.fingerprint import describe_ops_part, op_label, param_changes

__all__ = ["BUFFER_SPLIT", "lane_buffer_size", "refuse_unsplit", "unsplit_config"]

#: How ``buffer_size`` is shared among the lanes (:func:`lane_buffer_size`), as
#: ``Shuffle.config()`` records it. Shuffles once gave every lane the whole
#: ``buffer_size``; their config had no such entry, so the checkpoint
#: fingerprint of a state saved then differs (``buffer_split added``) and the
#: state is refused instead of resuming into another order. Change the text
#: if the rule ever changes again.
BUFFER_SPLIT = "ceil(buffer_size/num_lanes) per lane"


def lane_buffer_size(buffer_size: int, num_lanes: int) -> int:
    """Each lane's share of a shuffle's buffer: ``ceil(buffer_size / num_lanes)`` rows.

    It is the reservoir size of ``"streaming"`` and the (full) block size of
    ``"block"`` and ``"block_warmup"``. ``num_lanes`` is the source's, never
    the number of lanes a rank or worker runs, so the share, and with it
    the output, is the same on any world size and worker count. The lanes
    together hold ``num_lanes * share`` rows, at most ``buffer_size +
    num_lanes - 1``.

    Args:
        buffer_size: The shuffle's ``buffer_size`` (positive).
        num_lanes: The source's number of lanes (positive).

    Returns:
        The rows one lane holds, at least 2.

    Raises:
        ValueError: ``buffer_size <= num_lanes``: a share of one row, which
            would not shuffle at all.
    """
    share = -(-buffer_size // num_lanes)
    if share < 2:
        lanes = "lane" if num_lanes == 1 else "lanes"
        raise ValueError(
            f"shuffle(buffer_size={buffer_size}) over {num_lanes} {lanes} gives each lane a "
            f"buffer of 1 row, which does not shuffle at all: buffer_size is the pipeline's "
            f"whole buffer, shared by the source's lanes (ceil({buffer_size} / {num_lanes}) = "
            f"1 row per lane). Pass buffer_size >= {num_lanes + 1} (at least 2 rows per lane; "
            "a good mix needs far more, the default is 8192), or build the source with fewer "
            "lanes"
        )
    return share


def unsplit_config(config: Mapping[str, Any], saved: Mapping[str, str],
                   num_lanes: int) -> dict[str, Any] | None:
    """The config a shuffle saved unsplit had, when this shuffle gives its order.

    A state saved while a shuffle's ``buffer_size`` was each lane's buffer
    has no ``buffer_split`` in that operator's config (``saved``, its
    details). This pipeline's shuffle (``config``) gives the same order
    exactly when it has the same parameters and its lanes' share
    (:func:`lane_buffer_size`) is the old ``buffer_size``: then the old
    config, rebuilt from this one, has the state's digest. None when
    ``saved`` has the split, or ``config`` is no split shuffle's.
    """
    if "buffer_split" in saved:
        return None
    config = dict(config)
    if config.get("buffer_split") != BUFFER_SPLIT:
        return None
    try:
        share = lane_buffer_size(config["buffer_size"], num_lanes)
    except (KeyError, TypeError, ValueError):
        return None
    del config["buffer_split"]
    config["buffer_size"] = share
    return config


def refuse_unsplit(differ: Sequence[str], mine: Mapping[str, Any],
                   theirs: Mapping[str, Any], num_lanes: int) -> str | None:
    """The refusal of a state saved while a shuffle's ``buffer_size`` was each lane's.

    Such a state's shuffle has no ``buffer_split`` entry (:data:`BUFFER_SPLIT`)
    in its config. The generic message would tell the user to resume with the
    same operators, which they did; this one says what changed and what to
    do. None when no differing shuffle of the state predates the split.
    """
    old = [key for key in differ
           if key.startswith("ops[") and key.endswith("]") and key in theirs
           and f"{key}.buffer_split" in mine and f"{key}.buffer_split" not in theirs
           and f"{key}.buffer_size" in theirs
           and theirs.get(f"{key}.op") == mine.get(f"{key}.op")]
    if not old:
        return None
    shown = []
    for key in old:
        size = str(theirs[f"{key}.buffer_size"])
        prefix = f"{key}."
        here = {k[len(prefix):]: v for k, v in mine.items() if k.startswith(prefix)}
        there = {k[len(prefix):]: str(v) for k, v in theirs.items() if k.startswith(prefix)}
        # Any other parameter that changed too must be named, or the advice misleads.
        changed = param_changes(here, there, skip={"op", "buffer_size", "buffer_split"})
        shown.append(f"{key} {op_label(key, mine)} held buffer_size={size} rows in each of the "
                     f"{num_lanes} lanes" + (f", which is shuffle(buffer_size="
                                             f"{int(size) * num_lanes}) now" if size.isdigit()
                                             else "")
                     + (f"; also {', '.join(changed)}" if changed else ""))
    others = [describe_ops_part(k, mine, theirs) if k.startswith("ops") else k
              for k in differ if k not in old]
    also = f" The configuration also differs: {', '.join(others)}." if others else ""
    return (
        f"the state was saved by a zephon_torch from before shuffle's buffer_size became the "
        f"pipeline's whole buffer, shared by the lanes ({'; '.join(shown)}); this pipeline "
        f"shuffles in another order, so the state cannot resume it and nothing was loaded."
        f"{also} To resume the state exactly, build the shuffle with that buffer_size (the "
        "same rows per lane as then) and keep it for the rest of the run; else finish the run "
        "with the version that saved the state, or start afresh without it (see 'From an "
        "earlier zephon_torch: the shuffle buffer' in docs/migration.md)"
    )
