"""Generate on a real cluster when a worker dies or stops answering: a clear error in bounded
time, a usable kernel, and a working model again once the worker is back and placed again."""
import _thread
import signal
import subprocess
import threading
import time

import pytest
import tensorflow as tf

import tfnb
from tfnb.errors import WorkerLostError
from tfnb.models import tiny

PROMPT = "hello world"


@pytest.fixture
def setup(own_cluster):
    cluster = own_cluster
    model = tiny("llama")
    placed = tfnb.place(model, cluster.devices, cluster, timeout=5.0)
    expected = placed.generate_ids(PROMPT, max_new_tokens=48, chunk_tokens=4)  # compiles too
    return cluster, model, placed, expected


def _recover(own_workers, cluster, model, expected, task):
    own_workers.restart(task)
    report = cluster.reconnect()
    assert report["restarted"] == [cluster.workers[task]]
    assert report["lost"] == ["tiny-llama placed on 2 devices"]
    again = tfnb.place(model, cluster.devices, cluster, timeout=5.0)
    assert again.generate_ids(PROMPT, max_new_tokens=48, chunk_tokens=4) == expected


def test_worker_killed_mid_generate(own_workers, setup):
    cluster, model, placed, expected = setup
    stream = placed.generate_ids(PROMPT, max_new_tokens=48, stream=True, chunk_tokens=4)
    first = next(stream)
    assert first == expected[:4]
    own_workers.kill(1)
    start = time.monotonic()
    with pytest.raises(WorkerLostError, match="task:1") as e:
        list(stream)
    assert time.monotonic() - start < 5
    assert "place the model again" in str(e.value)
    _recover(own_workers, cluster, model, expected, 1)


def test_stopped_worker_times_out_and_the_kernel_stays_usable(own_workers, setup):
    cluster, model, placed, expected = setup
    own_workers.kill(0, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerLostError,
                           match="no answer within 5.0 s|task:0 .*stopped answering"):
            placed.generate_ids(PROMPT, max_new_tokens=48, chunk_tokens=4)
        assert time.monotonic() - start < 5.0 + 2.0
        st = cluster.status(timeout=1.0)  # the kernel still answers, and says which worker hangs
        assert st.states[own_workers.addresses[0]] == "unresponsive"
        with pytest.raises(WorkerLostError, match="no longer usable|place it again"):
            placed.generate_ids(PROMPT, max_new_tokens=4)
    finally:
        own_workers.kill(0, signal.SIGCONT)
    _recover(own_workers, cluster, model, expected, 0)


# A silent worker must not freeze the process: the bound below is the liveness probe's
# interval + timeout (tfnb.runtime.faults) + 2 s, far below the placed model's 60 s deadline.
LIVENESS_BOUND_S = 2.0 + 3.0 + 2.0


class _Stopped:
    """SIGSTOP a worker; a separate process resumes it after ``resume_s`` whatever happens
    here, so a regression that freezes this process fails the test instead of hanging CI."""

    def __init__(self, own_workers, task, resume_s=40):
        self.workers, self.task = own_workers, task
        pid = own_workers.pids[task]
        self.net = subprocess.Popen(["sh", "-c", f"sleep {resume_s}; kill -CONT {pid}"])

    def stop(self):
        self.workers.kill(self.task, signal.SIGSTOP)

    def resume(self):
        self.workers.kill(self.task, signal.SIGCONT)
        self.net.kill()
        self.net.wait()


def _in_background(fn):
    """Run ``fn`` in a thread, as a notebook user would; returns (thread, outcome dict)."""
    out = {}

    def run():
        start = time.monotonic()
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the outcome, whatever it is, is the result
            out["error"] = e
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _cells_keep_running(ipython, thread, n=6):
    """While ``thread`` waits on a silent worker, the kernel still runs cells, each at once."""
    for i in range(n):
        if not thread.is_alive():
            break
        start = time.monotonic()
        result = ipython.run_cell(f"_tfnb_probe = sum(range({i} * 1000))")
        assert result.success and time.monotonic() - start < 0.5
        time.sleep(0.3)


@pytest.fixture
def patient(setup):
    """The setup's placed model with a 60 s deadline: only liveness can fail a call early."""
    setup[2].timeout = 60.0
    return setup


# the shapes of a call: compiled before; a new prompt length (a new trace, sent to every worker
# as a new function); a new batch size (new KV caches as well)
SHAPES = {"compiled": dict(prompts=PROMPT, max_new_tokens=48),
          "new length": dict(prompts=[1] + list(range(40, 60)), max_new_tokens=40),
          "new batch": dict(prompts=[PROMPT, "other words", "x"], max_new_tokens=48)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_worker_stopped_before_a_call_fails_it_in_seconds_and_cells_run(own_workers, patient,
                                                                       ipython, shape):
    cluster, model, placed, expected = patient
    stopped = _Stopped(own_workers, 1)
    stopped.stop()
    try:
        thread, out = _in_background(lambda: placed.generate_ids(**SHAPES[shape], chunk_tokens=4))
        _cells_keep_running(ipython, thread)
        thread.join(LIVENESS_BOUND_S + 5)
        assert not thread.is_alive(), "the call did not return while the worker was stopped"
        assert isinstance(out.get("error"), WorkerLostError), out
        assert "task:1" in str(out["error"]) and out["seconds"] < LIVENESS_BOUND_S, out
    finally:
        stopped.resume()
    _recover(own_workers, cluster, model, expected, 1)


def test_worker_stopped_during_a_call_that_compiles(own_workers, patient, ipython, monkeypatch):
    """The worker stops right after the new function reached it, while it compiles and runs."""
    from tfnb.runtime.graphs import OnDevice

    cluster, model, placed, expected = patient
    stopped = _Stopped(own_workers, 0)
    call = OnDevice.__call__

    def traced_then_stopped(self, *args):
        self.trace(*args)                         # traced and sent to the own_workers
        stopped.stop()                            # before the own_workers compile and run it
        return call(self, *args)

    monkeypatch.setattr(OnDevice, "__call__", traced_then_stopped)
    try:
        thread, out = _in_background(lambda: placed.generate_ids([PROMPT] * 2, max_new_tokens=48))
        _cells_keep_running(ipython, thread)
        thread.join(LIVENESS_BOUND_S + 5)
        assert not thread.is_alive(), "the call did not return while the worker was stopped"
        assert isinstance(out.get("error"), WorkerLostError) and "task:0" in str(out["error"]), out
        assert out["seconds"] < LIVENESS_BOUND_S, out
    finally:
        monkeypatch.undo()
        stopped.resume()
    _recover(own_workers, cluster, model, expected, 0)


def test_worker_stopped_during_a_compiled_call(own_workers, patient):
    cluster, model, placed, expected = patient
    stream = placed.generate_ids(PROMPT, max_new_tokens=48, stream=True, chunk_tokens=4)
    assert next(stream) == expected[:4]
    stopped = _Stopped(own_workers, 1)
    stopped.stop()
    try:
        start = time.monotonic()
        with pytest.raises(WorkerLostError, match="task:1"):
            list(stream)
        assert time.monotonic() - start < LIVENESS_BOUND_S
    finally:
        stopped.resume()
    _recover(own_workers, cluster, model, expected, 1)


def test_worker_stopped_before_place_fails_placing_in_seconds(own_workers, setup):
    cluster, model, _, expected = setup
    stopped = _Stopped(own_workers, 1)
    stopped.stop()
    try:
        start = time.monotonic()
        with pytest.raises(WorkerLostError, match="task:1"):
            tfnb.place(model, cluster.devices, cluster, timeout=60.0)
        assert time.monotonic() - start < LIVENESS_BOUND_S
    finally:
        stopped.resume()
    _recover(own_workers, cluster, model, expected, 1)


def test_ctrl_c_stops_waiting_and_the_next_call_does_not_race_it(own_workers, setup):
    """Ctrl-C while a long call runs: the call stops at once, the graph finishes on the own_workers
    in the background, and the next call waits for it, then gives the same tokens."""
    cluster, model, placed, expected = setup
    long = dict(max_new_tokens=200)
    model_eos, placed.eos_ids = placed.eos_ids, ()  # every call makes all 200 tokens
    try:
        reference = placed.generate_ids(PROMPT, **long)  # compiles; the timed call is warm
        start = time.monotonic()
        assert placed.generate_ids(PROMPT, **long) == reference
        took = time.monotonic() - start
        timer = threading.Timer(took / 4, _thread.interrupt_main)
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            placed.generate_ids(PROMPT, **long)
        timer.cancel()
        assert time.monotonic() - start < took / 4 + 0.5  # stopped waiting at once
        assert placed.generate_ids(PROMPT, **long) == reference
        assert placed.generate_ids(PROMPT, max_new_tokens=48) == expected
    finally:
        placed.eos_ids = model_eos


def test_after_a_restart_apply_places_afresh_on_the_restarted_worker(own_workers, setup):
    """The editor's Apply passes previous=<last placed> to tfnb.place; after a restart that
    placement's variables on the worker are gone, so nothing of it may be reused."""
    from tfnb.notebook.widgets import PlacementEditor

    cluster, model, placed, expected = setup
    editor = PlacementEditor(model, cluster, mode="manual")
    for stage, device in placed.assignment.items():
        editor.set_device(stage, device)
    first = editor.apply()
    assert first is not None, editor.error
    assert first.generate_ids(PROMPT, max_new_tokens=48, chunk_tokens=4) == expected
    own_workers.restart(1)
    cluster.reconnect()
    again = editor.apply()
    assert again is not None and again is not first, editor.error
    assert again.moved_stages == list(again.assignment)  # every stage created afresh
    assert again.generate_ids(PROMPT, max_new_tokens=48, chunk_tokens=4) == expected


def test_a_call_failed_by_another_workers_loss_leaves_its_own_workers_usable(own_workers,
                                                                            own_cluster):
    """A worker's loss fails calls on workers that answer, with whatever error TF gives them.
    Here (probed on TF 2.21) an op on task:0 reading a tensor made on the killed task:1 fails
    with UnavailableError, then with InvalidArgumentError naming task:0. Both are reported as
    an unconfirmed WorkerLostError (nothing of task:0 was lost, so a router may run the
    request again), and the error names the lost worker."""
    from tfnb.runtime.faults import call_with_deadline

    here, there = own_cluster.devices
    with tf.device(there):
        made_there = tf.zeros([4]) + 1.0

    def read_it():
        with tf.device(here):
            return (made_there * 2.0).numpy()

    own_workers.kill(1)
    try:
        causes = []
        for _ in range(2):
            with pytest.raises(WorkerLostError, match="task:1") as e:
                call_with_deadline(read_it, (), timeout=10.0, devices=[here])
            assert not e.value.confirmed
            causes.append(type(e.value.__cause__).__name__)
        assert causes == ["UnavailableError", "InvalidArgumentError"]
        def fresh():
            with tf.device(here):
                return (tf.zeros([2]) + 3.0).numpy()

        assert call_with_deadline(fresh, (), timeout=10.0, devices=[here]).tolist() == [3.0, 3.0]
    finally:
        own_workers.restart(1)
        own_cluster.reconnect()
