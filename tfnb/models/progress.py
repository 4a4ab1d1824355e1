"""Progress reporting for long model-loading steps, as a plain callback.

A reporter is any callable ``report(done, total, what)``. Loaders call it with ``done == 0`` when a
step starts, with growing ``done`` while it runs, and with ``done == total`` when it ends.
``make_reporter`` turns the user's ``progress=`` argument into one:

- ``True``: a :class:`TqdmReporter`, one ``tqdm.auto`` bar per step: a widget inside a Jupyter
  kernel, a text bar on stderr in a terminal;
- ``False`` / ``None``: silent;
- a callable: used as is.
"""

from __future__ import annotations

from collections.abc import Callable

from tfnb.errors import ModelError

__all__ = ["Reporter", "make_reporter", "silent", "TqdmReporter"]

Reporter = Callable[[int, int, str], None]


def silent(done: int, total: int, what: str) -> None:
    """A reporter that reports nothing.

    Examples
    --------
    >>> silent(1, 2, "reading")
    """


class TqdmReporter:
    """A reporter drawing one tqdm bar per step (``what``), closed when the step ends.

    ``tqdm_class`` defaults to ``tqdm.auto.tqdm`` (a widget in a notebook, text elsewhere);
    other keywords go to each bar (``file=``, ``leave=`` ...). ``bar`` is the latest bar.

    Examples
    --------
    >>> import io
    >>> out = io.StringIO()
    >>> report = TqdmReporter(file=out)
    >>> report(0, 4, "reading"); report(4, 4, "reading")
    >>> "reading" in out.getvalue() and "4/4" in out.getvalue()
    True
    """

    def __init__(self, tqdm_class=None, **options):
        if tqdm_class is None:
            # here, not at the top: tqdm.auto imports IPython, and ipywidgets inside a kernel
            from tqdm.auto import tqdm as tqdm_class
        self.tqdm_class, self.options = tqdm_class, options
        self.bar = None
        self._open = False

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self._open or done == 0 or what != self.bar.desc:
            self.close()
            self.bar = self.tqdm_class(total=total, desc=what, **self.options)
            self._open = True
        if self.bar.total != total:
            self.bar.reset(total=total)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        """End the current bar (a finished step's bar stays on screen)."""
        if self._open:
            self.bar.close()
            self._open = False


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
        return TqdmReporter()
    raise ModelError(f"progress={progress!r}: expected True, False or a "
                     "callable(done, total, what)")
