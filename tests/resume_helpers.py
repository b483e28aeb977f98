"""What the resume-under-a-change tests share: a run's head and state, its resumed rest.

Not a test module itself (no ``test_`` prefix).
"""

from __future__ import annotations

import json
from typing import Any

from zephon_torch.pipeline import Pipeline


def head_and_state(pipe: Pipeline, steps: int, **kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """The first ``steps`` items of an inline run and its state, through JSON."""
    it = pipe.iter(runner="inline", **kwargs)
    head = [next(it) for _ in range(steps)]
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    return head, state


def resumed_rest(pipe: Pipeline, state: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Every item of a run of ``pipe`` (inline unless ``runner`` is given) from ``state``."""
    it = pipe.iter(**{"runner": "inline", **kwargs})
    it.load_state_dict(state)
    rest = list(it)
    it.close()
    return rest


def record_keys(items: list[Any]) -> list[tuple]:
    """The cursor keys of the records of a list of batches, in order."""
    return [r.meta.as_cursor_key() for b in items for r in b.records]
