"""A profile read after its cluster stopped, was disconnected or restarted a worker still holds
what was traced: stopping workers first takes in the traces still on their way
(tfnb.hooks.before_workers_stop -> tfnb.profiler.capture.collect_for). Each test has its own
2-worker local cluster, since each one stops, kills or restarts it."""
import signal
import subprocess
import sys
import time
import warnings

import pytest

import tfnb
import tfnb.profiler
from tfnb.cluster.security import ExposedServerWarning
from tfnb.profiler import capture

from tests.test_profiler import B, H, known_split  # each boundary moves B*H*4 bytes per call

CALLS = 150   # enough calls that the workers take a while to convert their traces


@pytest.fixture
def fresh():
    """A local cluster of 2 workers of this test's own, connected; stopped at the end."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExposedServerWarning)
        c = tfnb.local(2)
    yield c
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExposedServerWarning)
        c.stop()  # a second stop is a no-op


_split = known_split  # the split whose transfer sizes are known exactly


def _run(split, calls=CALLS):
    for _ in range(calls):
        z = split.chain(split.x)
    assert z.numpy().shape == (B, H)


def _assert_complete(prof, cluster, split, calls=CALLS):
    assert not prof.partial, prof.reasons
    assert set(prof.spaces) == set(cluster.workers) | {"client"}
    devs, nbytes, count = prof.transfer_matrix()
    for src, dst in ((split.w0, split.w1), (split.w1, split.w0)):
        assert nbytes[devs.index(src)][devs.index(dst)] == calls * B * H * 4
        assert count[devs.index(src)][devs.index(dst)] == calls


def _stop(cluster):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExposedServerWarning)
        cluster.stop()


@pytest.mark.parametrize("how", ["LocalCluster.close", "Cluster.stop"])
def test_profile_read_after_the_cluster_stopped_is_complete(fresh, how):
    split = _split(fresh)
    try:
        with tfnb.profiler.profile(fresh, timeout=30) as prof:
            _run(split)
    finally:  # as a script that closes its cluster in a finally
        fresh.local.close() if how == "LocalCluster.close" else _stop(fresh)
    assert not any(fresh.local.alive())
    _assert_complete(prof, fresh, split)


def test_profile_read_after_disconnect_needs_no_worker(fresh):
    split = _split(fresh)
    with tfnb.profiler.profile(fresh, timeout=30) as prof:
        _run(split)
    fresh.disconnect()
    for task in (0, 1):  # SIGKILL: nothing is collected on the way
        fresh.local.kill(task)
        fresh.local.procs[task].wait(10)
    _assert_complete(prof, fresh, split)


def test_worker_restart_collects_first(fresh):
    split = _split(fresh)
    with tfnb.profiler.profile(fresh, timeout=30) as prof:
        _run(split)
    fresh.local.restart(1)
    _assert_complete(prof, fresh, split)


def test_block_still_running_when_the_cluster_stops_is_ended_and_collected(fresh):
    split = _split(fresh)
    t0 = time.time_ns()
    with tfnb.profiler.profile(fresh, timeout=30) as prof:
        _run(split)
        _stop(fresh)
        t_stopped = time.time_ns()
        time.sleep(0.3)  # after the stop: not part of the trace window
    _assert_complete(prof, fresh, split)
    assert 0 < prof.window_ns < t_stopped - t0


def test_trace_not_in_before_the_cluster_stopped_makes_a_partial_profile_that_says_so(fresh,
                                                                                     monkeypatch):
    monkeypatch.setattr(capture, "STOP_WAIT_S", 1.0)
    split = _split(fresh)
    with tfnb.profiler.profile(fresh, timeout=30) as prof:
        _run(split)
        fresh.local.kill(1, signal.SIGSTOP)  # worker 1 will never answer its GetSnapshot
    t0 = time.monotonic()
    fresh.local.close()  # SIGTERM is held while stopped: SIGKILL after 5 s
    assert time.monotonic() - t0 < 1.0 + 5.0 + 4.0
    t1 = time.monotonic()
    reasons = prof.reasons
    assert time.monotonic() - t1 < 0.5  # nothing left to wait for
    assert set(reasons) == {fresh.workers[1]}, reasons
    why = reasons[fresh.workers[1]]
    assert fresh.spec.addresses[1] in why and "before the cluster was stopped" in why, why
    assert set(prof.spaces) == {fresh.workers[0], "client"}
    assert "PARTIAL" in repr(prof)


_EXIT = """
import sys, tfnb, tfnb.profiler, tensorflow as tf
c = tfnb.connect(sys.argv[1], timeout=10)
with tf.device(c.devices[1]):
    k = tf.Variable(tf.ones([96, 96]))
f = tf.function(lambda x: tf.matmul(x, k))
with tf.device(c.devices[0]):
    x = tf.identity(tf.ones([4, 96]))
f(x).numpy()
with tfnb.profiler.profile(c, timeout=20) as prof:
    for _ in range(30):
        y = f(x)
    y.numpy()
print("profiled", flush=True)  # and exits without reading the profile
"""


def test_exit_without_reading_is_bounded_and_leaves_no_worker_tracing(fresh):
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", _EXIT, ",".join(fresh.spec.addresses)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "profiled" in res.stdout, res.stderr[-2000:]
    assert time.monotonic() - t0 < 100
    with tfnb.profiler.profile(fresh, timeout=10) as prof:  # a session left running would refuse
        pass
    assert not prof.partial, prof.reasons
