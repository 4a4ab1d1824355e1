"""Run a TF call with a deadline and turn lost-worker failures into ``WorkerLostError``.

TensorFlow has no timeout for an op on a worker that stopped answering (a SIGSTOPped or
unreachable worker hangs the call forever), so the call runs in a daemon helper thread and the
caller waits with a deadline. A hung call cannot be cancelled; its thread is abandoned and the
caller is told to reconnect and place the model again.
"""

from __future__ import annotations

import re
import threading
from typing import Callable, Sequence

import tensorflow as tf

from tfnb.errors import WorkerLostError

__all__ = ["call_with_deadline", "devices_named_in", "LOST_WORKER_ERRORS"]

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
                       devices: Sequence[str], what: str = "generate"):
    """``fn(*args)``, raising ``WorkerLostError`` after ``timeout`` s or on a lost worker.

    Examples
    --------
    >>> call_with_deadline(lambda x: x + 1, (1,), timeout=5.0, devices=["/device:CPU:0"])
    2
    >>> import time
    >>> call_with_deadline(time.sleep, (2,), timeout=0.1, devices=["/device:CPU:0"])
    Traceback (most recent call last):
    ...
    tfnb.errors.WorkerLostError: generate got no answer within 0.1 s from devices ['/device:CPU:0']...
    """
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            result["error"] = e

    thread = threading.Thread(target=target, name=f"tfnb-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        silent = _unhealthy_workers(devices)
        where = f"; not answering now: {', '.join(silent)}" if silent else ""
        raise WorkerLostError(
            f"{what} got no answer within {timeout} s from devices {list(devices)}{where}: a "
            "worker may be stopped, hung or unreachable. Check the workers, reconnect the cluster "
            "and place the model again (this placed model is no longer usable).")
    if "error" in result:
        error = result["error"]
        down = _unhealthy_workers(devices) if isinstance(error, tf.errors.OpError) else []
        if isinstance(error, LOST_WORKER_ERRORS) or _resource_gone(error) or down:
            named = down or devices_named_in(str(error), devices) or list(devices)
            first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            raise WorkerLostError(
                f"{what} failed on device(s) {named}: {type(error).__name__}: {first_line}. "
                "The worker died or restarted; reconnect the cluster and place the model "
                "again.") from error
        raise error
    return result["value"]


def _unhealthy_workers(devices: Sequence[str], timeout: float = 1.0) -> list[str]:
    """Workers holding ``devices`` that do not answer a probe now, e.g. ``['127.0.0.1:3 (down)']``.

    A worker killed in the middle of a multi-device call surfaces as whatever error the
    surviving side saw (``InternalError: ... poisoned``, ``CancelledError``, ...); asking the
    workers is more reliable than reading the message.
    """
    from tfnb.cluster import current
    from tfnb.cluster.probe import probe_all

    cluster = current(required=False)
    if cluster is None:
        return []
    used = {d.split("/device:")[0] for d in devices}
    addresses = [a for (_, _, a), task in zip(cluster.spec.tasks(), cluster.workers) if task in used]
    return [f"{task_of(r.address, cluster)} at {r.address} ({r.state})"
            for r in probe_all(addresses, timeout) if r.state != "up"]


def task_of(address: str, cluster) -> str:
    return dict(zip(cluster.spec.addresses, cluster.workers))[address]


def _resource_gone(error: BaseException) -> bool:
    """A restarted worker no longer holds our variables: TF says the resource does not exist."""
    return (isinstance(error, (tf.errors.NotFoundError, tf.errors.FailedPreconditionError))
            and "/job:" in str(error)
            and ("does not exist" in str(error) or "uninitialized" in str(error).lower()))
