"""Hooks that one layer installs and another calls, so that neither imports the other.

``display_hook``: a factory of a live display for text generation, called once per generate or
chat call that has no ``on_chunk`` of its own. None in plain Python, so a script prints
nothing it did not ask for; ``%load_ext tfnb`` sets it, so a notebook shows the text, the token
count and tokens/s as chunks of tokens arrive (terminal IPython prints them as text).

``before_workers_stop``: callables ``hook(addresses, why, final)`` that the cluster package calls
before workers go away (``final=True``: a local cluster closing, a worker restarting, interpreter
exit) or before a cluster is disconnected (``final=False``: the workers keep running). The
profiler installs one when it is imported (``tfnb.profiler.capture.collect_for``), which takes in
the traces of finished profiles on those workers first; the cluster package never imports the
profiler (which imports it).
"""
from __future__ import annotations

import warnings

display_hook = None
before_workers_stop: list = []


def workers_stopping(addresses, why: str, *, final: bool) -> None:
    """Call every ``before_workers_stop`` hook for the workers at ``addresses``.

    ``why`` completes "before ...", e.g. ``"the cluster was stopped"``. A hook that fails is
    reported as a warning and never keeps the workers from stopping.

    Examples
    --------
    >>> from tfnb import hooks
    >>> seen = []
    >>> hooks.before_workers_stop.append(lambda a, why, final: seen.append((sorted(a), why, final)))
    >>> hooks.workers_stopping(["127.0.0.1:1"], "the cluster was stopped", final=True)
    >>> seen
    [(['127.0.0.1:1'], 'the cluster was stopped', True)]
    >>> del hooks.before_workers_stop[-1]
    """
    addresses = frozenset(addresses)
    for hook in list(before_workers_stop):
        try:
            hook(addresses, why, final)
        except Exception as e:  # noqa: BLE001 - stopping the workers must go on
            warnings.warn(f"{getattr(hook, '__qualname__', hook)!s} failed before {why}: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
