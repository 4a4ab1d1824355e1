"""Profile code across the cluster: TensorFlow's own traces from every worker and this process.

Examples
--------
>>> import tfnb                                          # doctest: +SKIP
>>> cluster = tfnb.local(2)                              # doctest: +SKIP
>>> with tfnb.profiler.profile() as prof:                # doctest: +SKIP
...     y = chain(x)
>>> prof.busy(); prof.transfers(chain); prof.plot()      # doctest: +SKIP
"""
from __future__ import annotations

import contextlib

from tfnb.errors import ProfileError
from tfnb.profiler.capture import Capture, check_timeout, resolve_cluster
from tfnb.profiler.profile import Profile


@contextlib.contextmanager
def profile(cluster=None, *, timeout: float = 60.0, trace_dir=None):
    """Trace every worker of ``cluster`` (default: the connected one) and this process while the
    ``with`` block runs; the yielded :class:`Profile` is filled when the block ends.

    Leaving the block only ends the trace window: the workers hand their traces back in the
    background, and the first read of the profile (``partial``, ``reasons``, any table, plot or
    display) waits for them, at most ``timeout`` seconds. Stopping, closing or disconnecting the
    cluster (or restarting a worker) takes them in first, within 10 s
    (``capture.STOP_WAIT_S``), so a profile read afterwards is complete or says why not; a block
    still running when its workers stop ends there.

    Parameters
    ----------
    cluster : tfnb.Cluster, optional
        Default: :func:`tfnb.current`. :class:`~tfnb.errors.ProfileError` when not connected.
    timeout : float
        Most seconds spent waiting for any worker to start or hand back its trace (default 60).
        A worker that is dead, silent or has no profiler service, or that dies before its trace
        is in, makes the profile ``partial``.
    trace_dir : str or path, optional
        Also write the raw traces there in TensorBoard's layout.

    Examples
    --------
    >>> with tfnb.profiler.profile(timeout=30) as prof:    # doctest: +SKIP
    ...     out = placed.generate("Hello", max_new_tokens=8)
    >>> prof.partial, prof.busy()                          # doctest: +SKIP
    """
    t = check_timeout(timeout)
    if trace_dir is not None and not str(trace_dir).strip():
        raise ProfileError(f"trace_dir={trace_dir!r}; expected a directory path")
    cap = Capture(resolve_cluster(cluster), timeout=t)
    prof = Profile()
    cap.start()
    try:
        yield prof
    finally:  # the block's own exception propagates; the capture is always stopped
        prof._fill(cap.stop())
        if trace_dir is not None:
            prof.export_tensorboard(trace_dir)


def profile_call(fn, *, cluster=None, timeout: float = 60.0, trace_dir=None) -> Profile:
    """Run ``fn()`` under :func:`profile` and return the Profile (what ``%%tfprofile`` calls).

    ``fn``'s exceptions propagate after the capture was stopped; the profile of the failed run is
    then attached to the exception as ``tfnb_profile``.

    Examples
    --------
    >>> prof = tfnb.profiler.profile_call(lambda: chain(x))   # doctest: +SKIP
    """
    if not callable(fn):
        raise ProfileError(f"fn={fn!r}; expected a callable taking no arguments")
    with profile(cluster, timeout=timeout, trace_dir=trace_dir) as prof:
        try:
            fn()
        except BaseException as e:
            e.tfnb_profile = prof
            raise
    return prof


__all__ = ["Profile", "ProfileError", "profile", "profile_call"]
