"""Keeping TensorFlow's own C++ log noise out of tfnb's commands, and out of interpreter exit.

Two sources, as TF 2.21 writes them on machines without a GPU:

* Start-up: ``cudart_stub.cc`` "Could not find cuda drivers", ``cuda_platform.cc`` "failed call to
  cuInit", oneDNN and CPU-feature notices, and absl's "All log messages before
  absl::InitializeLog() is called are written to STDERR". Some are written before absl reads
  ``TF_CPP_MIN_LOG_LEVEL``, so no setting hides them.
* Exit: every ``tf.function`` still alive when the interpreter ends asks each remote worker to
  remove it (``context.cc`` "Failed to remove function remotely ... EagerService/Enqueue ...
  Connection refused", four lines per function and worker) when the workers were stopped first,
  which is the normal order. :func:`skip_remote_cleanup_at_exit` stops those requests at exit,
  where they serve nothing: the process ends, and a worker drops the client's context with it.

:func:`filter_stderr` routes file descriptor 2 through a small filter process that drops the
start-up lines and those exit blocks and passes everything else on, untouched and in order. It
is a process, not a thread: TensorFlow may write to fd 2 from C++ while holding the GIL, and a
thread draining the pipe would then wait for the GIL while the writer waits for the pipe.

This file runs stand-alone (``python -S tflog.py``, standard library only) as that filter.
"""
from __future__ import annotations

import atexit
import os
import re
import sys

# A TF/absl log line: level letter, MMDD, time, thread id, file:line]
_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ (?P<file>[\w.-]+):\d+\] ")
_NOISY_FILES = ("cudart_stub.cc", "cuda_platform.cc", "cuda_executor.cc", "cuda_diagnostics.cc",
                "cuda_dnn.cc", "cuda_fft.cc", "cuda_blas.cc", "cpu_feature_guard.cc", "port.cc")
_NOISY_TEXT = ("Failed to remove function remotely", "Unable to close remote context",
               "Unable to destroy remote tensor handles",
               "Unable to destroy server_ object", "Failed to delete remote")
_STANDALONE = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
)
# lines TF appends to a failed remote call's log line
_CONTINUATION = ("Additional GRPC error information from remote target",
                 ":UNKNOWN:Error received from peer", ":UNAVAILABLE:",
                 "This could happen if the remote target has been disconnected from the client.")


class NoiseFilter:
    """Decides line by line what to pass on; remembers whether it is inside a dropped block.

    Examples
    --------
    >>> f = NoiseFilter()
    >>> f.keep("I0000 00:00:1.5  42 cudart_stub.cc:31] Could not find cuda drivers\\n")
    False
    >>> f.keep("Traceback (most recent call last):\\n")
    True
    """

    def __init__(self):
        self._in_block = False

    def keep(self, line: str) -> bool:
        text = line.rstrip("\n")
        m = _LOG.match(text)
        if m:
            level, name = text[0], m.group("file")
            noisy = level in "IW" or name in _NOISY_FILES or any(s in text for s in _NOISY_TEXT)
            self._in_block = noisy
            return not noisy
        if self._in_block and text.startswith(_CONTINUATION):
            return False
        self._in_block = False
        return text not in _STANDALONE


def _run_filter() -> int:
    """Copy stdin to stdout, dropping noise; runs until every writer has closed the pipe."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # Ctrl-C in a terminal must not lose the last lines
    f = NoiseFilter()
    src, out = sys.stdin.buffer, sys.stdout.buffer
    for raw in src:
        if f.keep(raw.decode(errors="replace")):
            out.write(raw)
            out.flush()
    return 0


_installed = False


def filter_stderr() -> bool:
    """Route this process's fd 2 (C++ and Python writes alike) through the noise filter.

    Call it before TensorFlow is imported. Returns False (and changes nothing) when it is already
    installed or cannot start. Child processes that inherit fd 2 are filtered too.

    Examples
    --------
    >>> filter_stderr()                            # doctest: +SKIP
    True
    """
    global _installed
    import subprocess

    if _installed:
        return False
    try:
        sys.stderr.flush()
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-u", os.path.abspath(__file__)],
                                stdin=subprocess.PIPE, stdout=os.dup(2), close_fds=True)
    except OSError:
        return False
    os.dup2(proc.stdin.fileno(), 2)
    proc.stdin.close()  # fd 2 is now the only write end: the filter ends when this process does
    _installed = True
    return True


_skip_registered = False


def skip_remote_cleanup_at_exit() -> None:
    """At interpreter exit, do not ask workers to remove this process's ``tf.function``\\ s.

    Registered when tfnb first connects (after TensorFlow is imported, so it runs before TF's own
    exit handlers). It clears TF's function reference table, which ``AtomicFunction.__del__``
    reads first (TF 2.21); in other TF versions, where that name is absent, it does nothing.
    """
    global _skip_registered
    if _skip_registered:
        return
    _skip_registered = True
    atexit.register(skip_remote_cleanup_now)


def skip_remote_cleanup_now() -> None:
    """From now on, freeing a ``tf.function`` does not ask the workers to remove it (for a
    process that is ending, or whose workers are all gone)."""
    mod = sys.modules.get("tensorflow.python.eager.polymorphic_function.atomic_function")
    if mod is not None and hasattr(mod, "RUNTIME_FUNCTION_REFS"):
        mod.RUNTIME_FUNCTION_REFS = None


if __name__ == "__main__":
    sys.exit(_run_filter())
