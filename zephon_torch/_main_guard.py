"""Worker processes and the main script's ``if __name__ == "__main__":`` guard.

Worker processes are started with ``spawn`` (or ``forkserver``), and such a
child first re-runs the parent's main script, under the name
``__mp_main__``, to find the functions and classes it will be sent. A script
whose top-level code starts a pipeline with worker processes, outside
``if __name__ == "__main__":``, therefore makes every worker start a
pipeline of its own while it boots, which ``multiprocessing`` refuses: the
workers die one after another, each with a long traceback that never says
what to change::

    train.py (the parent, __name__ == "__main__")      a worker (__name__ == "__mp_main__")
    line 12: pipe.iter(runner="process") ──spawn──►    re-runs train.py from the top
                                                       line 12: pipe.iter(runner="process")
                                                       -> cannot start processes while booting

:func:`unguarded_start` finds that case from the call stack: the frame that
runs the main script's top-level code, and whether its current line lies
inside an ``if __name__ == "__main__":`` block of the script. In the parent
it returns a sentence for the error the pool raises when its workers keep
dying; in a worker that is re-running the script it stops the worker at
once with that one line (``SystemExit``) instead of a traceback.
"""

from __future__ import annotations

import ast
import functools
import sys
from types import FrameType

__all__ = ["unguarded_start"]

_GUARD = 'if __name__ == "__main__":'


def _is_main_test(node: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1
            and isinstance(node.ops[0], ast.Eq)):
        return False
    sides = [node.left, node.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


@functools.lru_cache(maxsize=8)
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...] | None:
    """Line ranges of the top-level ``if __name__ == "__main__":`` bodies; None: unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    # The body only: an ``else:`` branch runs exactly where the guard is not true.
    return tuple((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno)
                 for node in tree.body
                 if isinstance(node, ast.If) and _is_main_test(node.test))


def _main_frame() -> FrameType | None:
    """The frame running the main script's top-level code, if it is on this stack.

    In the parent that is the module ``__main__``; in a spawned worker that
    re-runs the script it is ``__mp_main__`` (``__main__`` is then the
    worker's bootstrap, which has no file).
    """
    namespaces = [module.__dict__
                  for module in (sys.modules.get("__main__"), sys.modules.get("__mp_main__"))
                  if module is not None and getattr(module, "__file__", None)]
    if not namespaces:
        return None  # python -c, a REPL, a notebook: spawn re-runs nothing
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and any(frame.f_globals is ns
                                                      for ns in namespaces):
            return frame
        frame = frame.f_back
    return None


def unguarded_start() -> str | None:
    """Whether worker processes are being started by unguarded top-level code of the main script.

    Call it where worker processes are about to be started.

    Returns:
        ``None`` when they are not (the call comes from a function, from
        code under the guard, or there is no main script file); otherwise
        a sentence naming the script, the line and the missing guard, for
        the error raised when the workers keep dying.

    Raises:
        SystemExit: This process is a worker re-running the parent's main
            script, which reached the line that starts the workers: it stops
            here with one line on stderr (the parent reports the error).
    """
    frame = _main_frame()
    if frame is None:
        return None
    path = frame.f_code.co_filename
    line = frame.f_lineno
    guarded = _guarded_lines(path)
    if guarded is None or any(first <= line <= last for first, last in guarded):
        return None
    if frame.f_globals.get("__name__") == "__mp_main__":
        raise SystemExit(
            f"zephon: this worker process re-ran the main script {path}, whose line {line} "
            f"starts worker processes outside `{_GUARD}`; the worker stops here (the main "
            "process reports the error)"
        )
    return (f"the main script {path} starts them at line {line}, outside `{_GUARD}`: every "
            "worker process re-runs the main script when it starts (multiprocessing's spawn), "
            "reaches that line and tries to start workers of its own. Put the script's "
            f"top-level code under `{_GUARD}` (or use runner=\"threads\", which starts no "
            "process)")
