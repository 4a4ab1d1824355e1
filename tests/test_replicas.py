"""A replicated plan (the seed's MirroredStrategy mode) placed and serving concurrent requests on
real workers: each worker holds a full copy, requests spread over them, a lost one is dropped."""
import threading
import time
import warnings

import pytest

import tfnb
from tfnb.errors import WorkerLostError
from tfnb.models import tiny
from tfnb.runtime import ReplicaLostWarning, ReplicatedModel

PROMPTS = ["hello world", "the cat", "one two three", "x y", "good morning", "a b c d"]


@pytest.fixture
def setup(own_cluster):
    cluster = own_cluster
    model = tiny("llama")
    single = tfnb.place(model, [cluster.devices[0]], cluster)
    expected = {p: single.generate_ids(p, max_new_tokens=24) for p in PROMPTS}
    plan = tfnb.plan(model, cluster, mode="replicate", calibrate=False)
    placed = tfnb.place(model, plan, cluster)
    yield cluster, model, placed, expected
    placed.close()  # its healer stops: a copy it restores must not outlive the test


def concurrently(fn, items):
    """``fn(item)`` for every item, each in its own thread; results (or errors) by item."""
    out, threads = {}, []
    for item in items:
        def run(item=item):
            try:
                out[item] = fn(item)
            except BaseException as e:  # noqa: BLE001
                out[item] = e
        threads.append(threading.Thread(target=run))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return out


def test_a_replicated_plan_places_a_full_copy_per_worker(setup):
    cluster, model, placed, expected = setup
    assert isinstance(placed, ReplicatedModel) and placed.devices == cluster.devices
    for replica, device in zip(placed.replicas, cluster.devices):
        assert set(replica.assignment.values()) == {device}
        assert {v.device for v in replica.variables} == {device}
    assert placed.generate_ids(PROMPTS[0], max_new_tokens=24) == expected[PROMPTS[0]]


def test_concurrent_requests_run_on_both_replicas_with_the_same_tokens(setup):
    cluster, model, placed, expected = setup
    for p in PROMPTS[:2]:  # compile on both replicas before the concurrent round
        placed.generate_ids(p, max_new_tokens=24)
    before = dict(placed.served)
    got = concurrently(lambda p: placed.generate_ids(p, max_new_tokens=24), PROMPTS)
    assert got == expected
    served = {d: placed.served[d] - before[d] for d in placed.served}
    assert sum(served.values()) == len(PROMPTS) and all(n > 0 for n in served.values()), served


def test_streaming_on_a_replica_gives_the_same_text(setup):
    cluster, model, placed, expected = setup
    pieces = list(placed.generate_ids(PROMPTS[1], max_new_tokens=24, stream=True, chunk_tokens=5))
    assert [t for piece in pieces for t in piece] == expected[PROMPTS[1]]


def test_a_replica_whose_worker_dies_is_dropped_and_the_other_keeps_serving(own_workers, setup):
    """Requests that were on the lost replica are retried on the other (they had returned
    nothing yet); a stream on it fails, since part of it may have been shown."""
    cluster, model, placed, expected = setup
    for p in PROMPTS[:2]:
        placed.generate_ids(p, max_new_tokens=24)
    stream = placed.replicas[1].generate_ids(PROMPTS[2], max_new_tokens=24, stream=True,
                                             chunk_tokens=4)
    assert next(stream) == expected[PROMPTS[2]][:4]
    own_workers.kill(1)
    try:
        start = time.monotonic()
        with pytest.warns(ReplicaLostWarning, match="task:1"):
            results = concurrently(lambda p: placed.generate_ids(p, max_new_tokens=24), PROMPTS[:4])
        assert time.monotonic() - start < 30
        assert results == {p: expected[p] for p in PROMPTS[:4]}
        assert placed.devices == [cluster.devices[0]]
        with pytest.raises(WorkerLostError, match="task:1"):
            list(stream)
    finally:
        own_workers.restart(1)
        cluster.reconnect()


def test_a_request_keeps_its_tries_when_its_first_replica_is_dropped(own_workers, setup):
    """The request goes first to the replica whose worker died (the other is busy with a
    stream) and that replica is dropped. The survivor's next call can then fail too, though its
    worker is up ('Failed copying input tensor from /job:tfnb_client/... to .../task:0 ...:
    recvmsg:Connection reset by peer'; 1 of 2 runs failed so before the fix). The request keeps
    its tries: one per replica and one more, counted from the start."""
    cluster, model, placed, expected = setup
    for p in PROMPTS[:2]:
        placed.generate_ids(p, max_new_tokens=24)
    busy = placed.generate_ids(PROMPTS[2], max_new_tokens=24, stream=True, chunk_tokens=4)
    assert next(busy) == expected[PROMPTS[2]][:4]  # in flight on replica 0 while read
    assert placed.in_flight == {cluster.devices[0]: 1, cluster.devices[1]: 0}
    own_workers.kill(1)
    try:
        with pytest.warns(ReplicaLostWarning, match="task:1"):
            got = placed.generate_ids(PROMPTS[3], max_new_tokens=24)
        assert got == expected[PROMPTS[3]]
        assert placed.devices == [cluster.devices[0]]
    finally:
        busy.close()
        own_workers.restart(1)
        cluster.reconnect()


def test_a_request_whose_chunks_reached_its_caller_continues_on_the_other_copy(own_workers,
                                                                              setup):
    """Its first chunk is out when its copy's worker dies: the rest is made on the other copy
    from the prompt and the tokens made so far, so ``on_chunk`` sees every chunk once and the
    tokens are those of a run without the fault."""
    cluster, model, placed, expected = setup
    eos, placed.eos_ids = placed.eos_ids, ()  # the request runs long after its first chunk
    whole = placed.generate_ids(PROMPTS[3], max_new_tokens=120, chunk_tokens=4)
    seen, lost = [], []

    def on_chunk(event):
        seen.append((event.index, event.new_ids[0]))
        if not lost:  # the first chunk is out: its replica's worker dies
            lost.append(next(i for i, d in enumerate(cluster.devices) if placed.in_flight[d]))
            own_workers.kill(lost[0])

    try:
        with pytest.warns(ReplicaLostWarning):
            got = placed.generate_ids(PROMPTS[3], max_new_tokens=120, chunk_tokens=4,
                                      on_chunk=on_chunk)
        assert got == whole
        assert [i for i, _ in seen] == list(range(len(seen)))  # no chunk handed over twice
        assert [t for _, ids in seen for t in ids] == whole
        assert placed.last_stats["moves"] == 1
    finally:
        placed.eos_ids = eos
        own_workers.restart(lost[0] if lost else 1)
        cluster.reconnect()


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.8, "seed": 7}],
                         ids=["greedy", "seeded-sample"])
def test_a_stream_survives_its_copys_loss_with_the_same_tokens(own_workers, setup, sampling):
    """A stream through the router whose copy is lost mid-way goes on on the other copy; the
    caller reads one stream with the tokens of a run without the fault (a seeded sample too:
    each token's random numbers are keyed by its position)."""
    cluster, model, placed, expected = setup
    eos, placed.eos_ids = placed.eos_ids, ()
    whole = placed.generate_ids(PROMPTS[4], max_new_tokens=100, **sampling)
    stream = placed.generate_ids(PROMPTS[4], max_new_tokens=100, stream=True, chunk_tokens=4,
                                 **sampling)
    pieces = [next(stream)]
    victim = next(i for i, d in enumerate(cluster.devices) if placed.in_flight[d])
    own_workers.kill(victim)
    try:
        with pytest.warns(ReplicaLostWarning, match=f"task:{victim}"):
            pieces += list(stream)
        assert [t for p in pieces for t in p] == whole
        assert placed.devices == [cluster.devices[1 - victim]]
    finally:
        placed.eos_ids = eos
        own_workers.restart(victim)
        cluster.reconnect()


def test_a_request_outlasts_failures_that_leave_its_replica_serving(setup, monkeypatch):
    """Right after a worker's loss, calls on a replica whose workers answer can fail too (an
    unconfirmed WorkerLostError; test_faults shows TF doing it). The request goes on after
    a pause that doubles each time, up to SPARE_TRIES times, and the replica keeps serving;
    a request that fails on every try gives up with the error. The failures are injected at
    the replica's scheduler (each ticket it hands out fails at its first event): TF gives
    them only by chance, in a worker's dying moments."""
    from tfnb.runtime.replicas import SETTLE_S, SPARE_TRIES

    cluster, model, placed, expected = setup
    first = placed.replicas[0]
    real, failed = first.scheduler.submit, []

    def failing(times):
        def submit(*args, **kwargs):
            ticket = real(*args, **kwargs)
            if len(failed) < times:
                failed.append(time.monotonic())

                def fail(timeout):
                    raise WorkerLostError("generate failed while task:7 is lost",
                                          confirmed=False)
                ticket.next = fail
            return ticket
        return submit

    monkeypatch.setattr(first.scheduler, "submit", failing(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicaLostWarning)
        assert placed.generate_ids(PROMPTS[0], max_new_tokens=24) == expected[PROMPTS[0]]
    assert len(failed) == 3 and placed.replicas[0] is first and len(placed.replicas) == 2
    gaps = [b - a for a, b in zip(failed, failed[1:])]
    assert gaps[0] >= SETTLE_S and gaps[1] >= 2 * SETTLE_S, gaps

    failed.clear()
    monkeypatch.setattr(first.scheduler, "submit", failing(100))
    with pytest.raises(WorkerLostError, match="task:7"):
        placed.generate_ids(PROMPTS[0], max_new_tokens=24)
    assert len(failed) == 1 + SPARE_TRIES and len(placed.replicas) == 2
