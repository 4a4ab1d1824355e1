"""Run a TF call with a deadline and liveness probes; turn lost-worker failures into
``WorkerLostError``.

TensorFlow has no timeout for an op on a worker that stopped answering (a SIGSTOPped or
unreachable worker hangs the call forever), so the call runs in a daemon helper thread and the
caller waits: until the deadline, and meanwhile probes the workers the call uses every
``PROBE_EVERY_S`` seconds (TF's GetStatus, as ``Cluster.status()`` does). A worker that does not
answer a probe within its timeout fails the call at once, whatever the deadline (a first call
that compiles may be allowed minutes). A hung call cannot be cancelled; its thread is abandoned
and the caller is told to reconnect and place the model again.

Waiting is only possible while the helper thread does not hold the GIL. Two TF calls do hold it
while a remote worker is silent (TF 2.21): converting a
Python or numpy value to a tensor under a remote device scope (``graphs.OnDevice`` and
``weights`` make every value on the client first), and registering a newly traced function
with the eager context, which sends it to every worker and waits (``TFE_ContextAddFunction``).
For the latter, :func:`guard_function_registration` probes the workers right before each
registration and raises instead of entering the call when one is silent.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence

import tensorflow as tf
from tensorflow.python.eager import context

from tfnb.errors import WorkerLostError
from tfnb.shutdown import start_thread

__all__ = ["call_with_deadline", "devices_named_in", "LOST_WORKER_ERRORS",
           "guard_function_registration", "silent_workers", "PROBE_EVERY_S", "PROBE_TIMEOUT_S"]

PROBE_EVERY_S = 2.0   # liveness probe interval while a call runs
PROBE_TIMEOUT_S = 3.0  # a worker silent this long is lost (GetStatus answers in ~1 ms)

# Errors TF raises when a worker died, restarted (its resources are gone) or the link broke.
LOST_WORKER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.DeadlineExceededError,
    tf.errors.CancelledError,
)

_TASK = re.compile(r"/job:([\w-]+)/replica:(\d+)/task:(\d+)")


def devices_named_in(message: str, devices: Sequence[str]) -> list[str]:
    """The devices in ``devices`` whose job/task appears in ``message`` (an error text).

    Examples
    --------
    >>> devices_named_in("Socket closed /job:worker/replica:0/task:1",
    ...                  ["/job:worker/replica:0/task:0/device:CPU:0",
    ...                   "/job:worker/replica:0/task:1/device:CPU:0"])
    ['/job:worker/replica:0/task:1/device:CPU:0']
    """
    tasks = set(_TASK.findall(message))
    named = [d for d in devices if any(t in tasks for t in _TASK.findall(d))]
    return named or [d for d in devices if d in message]


def call_with_deadline(fn: Callable, args: tuple, *, timeout: float | None,
                       devices: Sequence[str], what: str = "generate",
                       probe_timeout: float | None = PROBE_TIMEOUT_S,
                       on_start: Callable[[threading.Thread], None] | None = None):
    """``fn(*args)``, raising ``WorkerLostError`` after ``timeout`` s, when a worker holding
    ``devices`` stops answering probes (``probe_timeout``; None: no probes), or on a lost worker.
    A TF error while the workers holding ``devices`` answer but another worker of the cluster
    is lost becomes an unconfirmed ``WorkerLostError`` naming that worker (see
    ``_lost_elsewhere``).

    ``on_start`` gets the helper thread, so a caller interrupted by Ctrl-C can wait for the call
    it left running before starting another.

    Examples
    --------
    >>> call_with_deadline(lambda x: x + 1, (1,), timeout=5.0, devices=["/device:CPU:0"])
    2
    >>> import time
    >>> call_with_deadline(time.sleep, (2,), timeout=0.1,
    ...                    devices=["/device:CPU:0"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfnb.errors.WorkerLostError: generate got no answer within 0.1 s from devices ...
    """
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            result["error"] = e

    thread = start_thread(target, name=f"tfnb-{what}")
    if on_start is not None:
        on_start(thread)
    _wait(thread, timeout, devices, what, probe_timeout)
    if "error" in result:
        error = result["error"]
        message = str(error)
        if isinstance(error, WorkerLostError) or "WorkerLostError: " in message:
            # raised while tracing (by guard_function_registration): TF's autograph re-raises
            # it with its trace in front, as the same type or as a StagingError
            raise WorkerLostError(message[message.rfind("WorkerLostError: ") + 17:].strip()
                                  if "WorkerLostError: " in message else message) from None
        down = _unhealthy_workers(devices) if isinstance(error, tf.errors.OpError) else []
        gone = _resource_gone(error)
        lost_here = isinstance(error, LOST_WORKER_ERRORS) or gone or down
        elsewhere = (_lost_elsewhere(devices)
                     if not lost_here and isinstance(error, tf.errors.OpError) else [])
        if elsewhere:
            first_line = str(error).strip().splitlines()[0][:300]
            raise WorkerLostError(
                f"{what} failed ({type(error).__name__}: {first_line}) while "
                f"{', '.join(elsewhere)}, which it does not use, is lost. Its own workers "
                "answer, so nothing of it was lost: run it again.", confirmed=False) from error
        if lost_here:
            named = down or devices_named_in(str(error), devices) or list(devices)
            first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            raise WorkerLostError(
                f"{what} failed on device(s) {named}: {type(error).__name__}: {first_line}. "
                "The worker died or restarted; reconnect the cluster and place the model "
                "again.", confirmed=bool(down) or gone or isinstance(error, tf.errors.AbortedError)
            ) from error
        raise error
    return result["value"]


def _wait(thread: threading.Thread, timeout: float | None, devices: Sequence[str], what: str,
          probe_timeout: float | None) -> None:
    """Join ``thread`` until it ends; WorkerLostError at the deadline or on a silent worker."""
    deadline = None if timeout is None else time.monotonic() + timeout
    addresses = _worker_addresses(devices) if probe_timeout else {}
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        thread.join(PROBE_EVERY_S if left is None else max(0.0, min(PROBE_EVERY_S, left)))
        if not thread.is_alive():
            return
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            silent = _unhealthy_workers(devices)
            where = f"; not answering now: {', '.join(silent)}" if silent else ""
            raise WorkerLostError(
                f"{what} got no answer within {timeout} s from devices {list(devices)}{where}: "
                "a worker may be stopped, hung or unreachable. Check the workers, reconnect the "
                "cluster and place the model again (this placed model is no longer usable).")
        if addresses:
            # the probe may use what is left of the deadline, not more
            wait = probe_timeout if left is None else max(0.2, min(probe_timeout, left))
            silent = silent_workers(addresses, wait)
            if silent and thread.is_alive():
                raise WorkerLostError(
                    f"{what} stopped: {', '.join(silent)}, used by this call, stopped answering "
                    f"(no reply to a status probe within {wait:g} s). The worker may be stopped "
                    "or hung; check it, reconnect the cluster and place the model again.")


def _worker_addresses(devices: Sequence[str] | None) -> dict[str, str]:
    """``{address: task}`` of the current cluster's workers that hold ``devices`` (None: all)."""
    from tfnb.cluster import current

    cluster = current(required=False)
    if cluster is None:
        return {}
    used = None if devices is None else {d.split("/device:")[0] for d in devices}
    return {address: task for address, task in zip(cluster.spec.addresses, cluster.workers)
            if used is None or task in used}


def silent_workers(addresses: dict[str, str], timeout: float,
                   states=("unresponsive",)) -> list[str]:
    """``["<task> at <address> (<why>)"]`` for the workers whose probe state is in ``states``."""
    from tfnb.cluster.probe import probe_all

    return [f"{addresses[r.address]} at {r.address} ({r.state}: {r.error})" if r.error else
            f"{addresses[r.address]} at {r.address} ({r.state})"
            for r in probe_all(list(addresses), timeout) if r.state in states]


def guard_function_registration() -> None:
    """Probe the current cluster's workers before TF registers a new function with them.

    Registration holds the GIL until every worker has answered (see the module docstring), so
    a silent worker would freeze the whole process, a notebook kernel included. With the guard,
    tracing a new function while a worker is silent raises ``WorkerLostError`` naming it. A
    worker that is down (connection refused) is left to TF, which fails fast itself. A worker
    that stops in the moment between the probe and the registration is not caught. Installed
    once per process, by importing this module; it costs one probe (about 1 ms on loopback)
    per registered function and nothing while no cluster is connected.
    """
    original = context.Context.add_c_function
    if getattr(original, "tfnb_guard", False):
        return

    def add_c_function(self, c_func):
        addresses = _worker_addresses(None) if self._context_handle is not None else {}
        if addresses:
            silent = silent_workers(addresses, PROBE_TIMEOUT_S)
            if silent:
                raise WorkerLostError(
                    f"cannot send a new function to the cluster: {', '.join(silent)} stopped "
                    "answering. Check the worker, reconnect the cluster and place the model "
                    "again.")
        return original(self, c_func)

    add_c_function.tfnb_guard = True
    context.Context.add_c_function = add_c_function


guard_function_registration()


def _unhealthy_workers(devices: Sequence[str], timeout: float = 1.0) -> list[str]:
    """Workers holding ``devices`` that do not answer a probe now, e.g.
    ``['/job:worker/replica:0/task:1 at 127.0.0.1:3 (down)']``.

    A worker killed in the middle of a multi-device call surfaces as whatever error the
    surviving side saw (``InternalError: ... poisoned``, ``CancelledError``, ...); asking the
    workers is more reliable than reading the message.
    """
    return silent_workers(_worker_addresses(devices), timeout, states=("down", "unresponsive"))


def _lost_elsewhere(devices: Sequence[str]) -> list[str]:
    """The cluster's workers outside ``devices`` that are down or silent now.

    A worker's loss can fail calls on the others (TF 2.21): ops on a surviving worker that
    read a tensor the lost one made fail with ``UnavailableError: Failed copying input tensor
    ...`` and then ``InvalidArgumentError: Unable to find the relevant tensor remote_handle
    ...``, naming a worker that answers; a fresh op there then runs (docs/faults.md).
    """
    ours = set(_worker_addresses(devices).values())
    return _unhealthy_workers([t for t in _worker_addresses(None).values() if t not in ours])


def _resource_gone(error: BaseException) -> bool:
    """A restarted worker no longer holds our variables: TF says the resource does not exist."""
    return (isinstance(error, (tf.errors.NotFoundError, tf.errors.FailedPreconditionError))
            and "/job:" in str(error)
            and ("does not exist" in str(error) or "uninitialized" in str(error).lower()))
