"""Threads that call TensorFlow, ended before the interpreter finalizes.

Python ends a daemon thread that wants the GIL during finalization by unwinding its stack; a
thread coming back from TensorFlow's C++ code (a compile, a remote call) is unwound through
frames that catch every exception, and the whole process aborts (SIGABRT, "FATAL: exception not
rethrown"). So every tfnb thread that calls TensorFlow is started here: at exit (``atexit``
runs before finalization) each is told to stop and joined once its call under way returns.

Examples
--------
>>> import threading
>>> done = threading.Event()
>>> start_thread(done.set, name="tfnb-example").join()
>>> done.is_set(), exiting()
(True, False)
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

__all__ = ["start_thread", "exiting", "EXIT_WAIT_S"]

EXIT_WAIT_S = 60.0  # at exit, how long the calls under way may take to return, in all

_exiting = threading.Event()
_threads: dict[threading.Thread, threading.Condition | None] = {}  # live thread -> its wake-up
_lock = threading.Lock()


def exiting() -> bool:
    """True once the interpreter is exiting: a thread's loop should end at its next turn."""
    return _exiting.is_set()


def start_thread(target: Callable, *args, name: str,
                 wake: threading.Condition | None = None) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread that the exit waits for.

    ``wake`` is a condition the thread may sleep on; at exit it is notified so that a thread
    waiting for work sees :func:`exiting` at once.
    """
    def run():
        try:
            target(*args)
        finally:
            with _lock:
                _threads.pop(threading.current_thread(), None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:  # registered and started at once: the exit joins only started threads
        _threads[thread] = wake
        thread.start()
    return thread


@atexit.register
def _join_all(timeout: float = EXIT_WAIT_S) -> None:
    _exiting.set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # a thread may start another before it ends
        with _lock:
            threads = list(_threads.items())
        if not threads:
            return
        for _, wake in threads:
            if wake is not None:
                with wake:
                    wake.notify_all()
        for thread, _ in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
