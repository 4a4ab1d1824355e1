"""Progress reporting for long model-loading steps, as a plain callback.

A reporter is any callable ``report(done, total, what)``. Loaders call it with ``done == 0`` when a
step starts, with growing ``done`` while it runs, and with ``done == total`` when it ends.
``make_reporter`` turns the user's ``progress=`` argument into one:

- ``True``: a one-line ``\\r`` bar on stderr in a terminal, or an ipywidgets bar inside a Jupyter
  kernel (ipywidgets is imported only then, and a text bar is used if it is missing);
- ``False`` / ``None``: silent;
- a callable: used as is.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

__all__ = ["Reporter", "make_reporter", "silent", "TextReporter", "WidgetReporter", "in_kernel"]

Reporter = Callable[[int, int, str], None]


def silent(done: int, total: int, what: str) -> None:
    """A reporter that reports nothing.

    Examples
    --------
    >>> silent(1, 2, "reading")
    """


def in_kernel() -> bool:
    """True inside a Jupyter (ipykernel) kernel, False in a terminal or plain script.

    Examples
    --------
    >>> in_kernel()
    False
    """
    ipython_mod = sys.modules.get("IPython")
    if ipython_mod is None:
        return False
    try:
        shell = ipython_mod.get_ipython()
    except Exception:  # noqa: BLE001 - any failure means "not a kernel"
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class TextReporter:
    """A ``\\r``-style one-line progress bar written to a stream (stderr by default).

    Redraws at most every ``min_interval`` seconds, and always at the start and end of a step.

    Examples
    --------
    >>> import io
    >>> out = io.StringIO()
    >>> report = TextReporter(stream=out, width=10)
    >>> report(0, 4, "reading"); report(4, 4, "reading")
    >>> out.getvalue().splitlines()[-1].strip().endswith("4/4")
    True
    """

    def __init__(self, stream=None, width: int = 30, min_interval: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval = min_interval
        self._last = 0.0
        self._started = 0.0

    def __call__(self, done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if done == 0:
            self._started = now
        finished = done >= total
        if not finished and done and now - self._last < self.min_interval:
            return
        self._last = now
        frac = done / total if total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = now - self._started
        self.stream.write(f"\r{what:<14} [{bar}] {elapsed:5.1f}s {done}/{total}")
        if finished:
            self.stream.write("\n")
        self.stream.flush()


class WidgetReporter:
    """An ipywidgets ``IntProgress`` bar with a label, for Jupyter kernels.

    Examples
    --------
    >>> report = WidgetReporter()  # doctest: +SKIP
    >>> report(3, 10, "dequantizing")  # doctest: +SKIP
    """

    def __init__(self):
        import ipywidgets
        from IPython.display import display

        self._bar = ipywidgets.IntProgress(min=0, max=1, value=0)
        self._label = ipywidgets.Label("")
        self._box = ipywidgets.HBox([self._bar, self._label])
        display(self._box)

    def __call__(self, done: int, total: int, what: str) -> None:
        self._bar.max = max(total, 1)
        self._bar.value = min(done, self._bar.max)
        self._label.value = f"{what} {done}/{total}"
        self._bar.bar_style = "success" if done >= total else ""


def make_reporter(progress) -> Reporter:
    """The reporter for a ``progress=`` argument (``True``, ``False``/``None`` or a callable).

    Examples
    --------
    >>> make_reporter(False) is silent
    True
    >>> seen = []
    >>> make_reporter(lambda d, t, w: seen.append(d))(1, 2, "x"); seen
    [1]
    """
    if progress is None or progress is False:
        return silent
    if callable(progress):
        return progress
    if progress is True:
        if in_kernel():
            try:
                return WidgetReporter()
            except ImportError:
                pass
        return TextReporter()
    from tfnb.errors import ModelError

    raise ModelError(f"progress={progress!r}: expected True, False or a callable(done, total, what)")
