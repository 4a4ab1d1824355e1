"""Shared fixtures: real TF worker processes on 127.0.0.1, one cluster per test session."""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import faulthandler
import warnings

import pytest

# pytest-timeout (600 s, pyproject) fails a test from a Python signal handler, which cannot run
# while a C call holds the GIL; TF's set_server_def can hang that way. This watchdog runs in C:
# past its limit it prints every thread's stack to the real stderr and ends the run, so a hang
# costs one test's limit, not the whole CI budget.
WATCHDOG_S = float(os.environ.get("TFNB_TEST_WATCHDOG_S", 900))


def pytest_configure(config):
    config._tfnb_stderr = os.fdopen(os.dup(2), "w")  # before output capture replaces fd 2


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=item.config._tfnb_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def local_workers():
    """Two worker processes for the whole session (starting TF costs seconds each)."""
    from tfnb.cluster import LocalCluster

    lc = LocalCluster(2)
    yield lc
    lc.close()


def _connect(workers):
    import tfnb
    from tfnb.cluster.security import ExposedServerWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExposedServerWarning)
        return tfnb.connect(workers, timeout=5.0)


@pytest.fixture
def cluster(local_workers):
    """This process connected to the session's two workers (reconnects if a test moved it)."""
    return _connect(local_workers)


@pytest.fixture
def tf_warnings():
    """The messages TensorFlow's logger warns with during the test (what a notebook cell shows
    under its output), as a list that fills while the test runs."""
    import logging

    import tensorflow as tf

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    seen = Records()
    tf.get_logger().addHandler(seen)
    try:
        yield seen.messages
    finally:
        tf.get_logger().removeHandler(seen)


def local_cluster(n: int):
    """``n`` worker processes, closed when the fixture that yields from this ends."""
    from tfnb.cluster import LocalCluster

    lc = LocalCluster(n)
    yield lc
    lc.close()


@pytest.fixture(scope="module")
def own_workers():
    """Two worker processes of the test module's own, for tests that stop, kill or restart them."""
    yield from local_cluster(2)


@pytest.fixture
def own_cluster(own_workers):
    """This process connected to the module's own workers."""
    return _connect(own_workers)


@pytest.fixture(scope="session")
def ipython():
    """A real IPython shell with the tfnb extension loaded (one per session, as IPython allows)."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "tfnb")
    return shell


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """The run is over: the TF functions still alive are freed as the process ends, after the
    test workers were stopped, and each would ask every worker of the last connected cluster to
    remove it ("Failed to remove function remotely", four lines per function and worker, some
    thousand lines after the summary). tfnb skips those requests at exit
    (``tflog.skip_remote_cleanup_at_exit``); here they are skipped from now on, since pytest
    frees much of it before the interpreter's exit handlers run."""
    from tfnb.cluster.tflog import skip_remote_cleanup_now

    skip_remote_cleanup_now()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line at the end: how many tests skipped, grouped by reason (machines differ: root,
    ``ip netns``, nftables, chromium), so two runs can be compared at a glance."""
    import collections

    reasons = collections.Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = rep.longrepr
        reason = (longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3
                  else str(longrepr))
        reasons[reason.removeprefix("Skipped: ").strip()] += 1
    total = sum(reasons.values())
    if not total:
        terminalreporter.write_line("skipped: none")
        return
    parts = "; ".join(f"{n} x {why}" for why, n in reasons.most_common())
    terminalreporter.write_line(f"skipped: {total} ({parts})")


@pytest.fixture(autouse=True)
def _no_display_hook():
    """Every test starts as a script does, with no live display for generate calls: loading
    the extension into the session's terminal IPython (``ipython``) installs a text one, which
    would otherwise print and chunk the generate calls of every later test."""
    from tfnb import hooks

    hooks.display_hook = None
    yield
    hooks.display_hook = None
