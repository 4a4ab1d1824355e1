"""Generate on a real cluster when a worker dies or stops answering: a clear error in bounded
time, a usable kernel, and a working model again once the worker is back and placed again."""
import signal
import time
import warnings

import pytest

import tfnb
from tfnb.cluster import LocalCluster
from tfnb.errors import WorkerLostError
from tfnb.models import tiny

PROMPT = "hello world"


@pytest.fixture(scope="module")
def workers():
    lc = LocalCluster(2)
    yield lc
    lc.close()


@pytest.fixture
def setup(workers):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = tfnb.connect(workers)
    model = tiny("llama")
    placed = tfnb.place(model, cluster.devices, cluster, timeout=5.0)
    expected = placed.generate_ids(PROMPT, max_new_tokens=48, chunk_tokens=4)  # compiles too
    return cluster, model, placed, expected


def _recover(workers, cluster, model, expected, task):
    workers.restart(task)
    report = cluster.reconnect()
    assert report["restarted"] == [cluster.workers[task]]
    assert report["lost"] == ["tiny-llama placed on 2 devices"]
    again = tfnb.place(model, cluster.devices, cluster, timeout=5.0)
    assert again.generate_ids(PROMPT, max_new_tokens=48, chunk_tokens=4) == expected


def test_worker_killed_mid_generate(workers, setup):
    cluster, model, placed, expected = setup
    stream = placed.generate_ids(PROMPT, max_new_tokens=48, stream=True, chunk_tokens=4)
    first = next(stream)
    assert first == expected[:4]
    workers.kill(1)
    start = time.monotonic()
    with pytest.raises(WorkerLostError, match="task:1") as e:
        list(stream)
    assert time.monotonic() - start < 5
    assert "place the model again" in str(e.value)
    _recover(workers, cluster, model, expected, 1)


def test_stopped_worker_times_out_and_the_kernel_stays_usable(workers, setup):
    cluster, model, placed, expected = setup
    workers.kill(0, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerLostError, match="no answer within 5.0 s"):
            placed.generate_ids(PROMPT, max_new_tokens=48, chunk_tokens=4)
        assert time.monotonic() - start < 5.0 + 2.0
        st = cluster.status(timeout=1.0)  # the kernel still answers, and says which worker hangs
        assert st.states[workers.addresses[0]] == "unresponsive"
        with pytest.raises(WorkerLostError, match="no longer usable|place it again"):
            placed.generate_ids(PROMPT, max_new_tokens=4)
    finally:
        workers.kill(0, signal.SIGCONT)
    _recover(workers, cluster, model, expected, 0)
