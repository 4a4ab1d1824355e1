"""A hybrid plan on real workers: when a full copy does not fit one worker, ``mode="replicate"``
makes each copy a pipeline over two of the four workers. Concurrent requests spread over both
copies and get the tokens one device gives; a lost worker drops only the copy it held."""
import time

import pytest

import tfnb
from tfnb.models import tiny
from tfnb.placement.cost import stage_memory
from tfnb.runtime import ReplicaLostWarning, ReplicatedModel

from tests.conftest import _connect, local_cluster
from tests.test_replicas import PROMPTS, concurrently


@pytest.fixture(scope="module")
def four_workers():
    yield from local_cluster(4)


@pytest.fixture
def setup(four_workers):
    cluster = _connect(four_workers)
    model = tiny("llama")
    single = tfnb.place(model, [cluster.devices[0]], cluster)
    expected = {p: single.generate_ids(p, max_new_tokens=16) for p in PROMPTS}
    # a copy with its KV cache needs more than one worker is given, half of it less
    cap = int(0.6 * sum(stage_memory(model.chain, 1, 1024)))
    plan = tfnb.plan(model, cluster, mode="replicate", calibrate=False, max_memory=cap)
    placed = tfnb.place(model, plan, cluster)
    yield cluster, plan, placed, expected
    placed.close()  # its healer stops with the test


def test_each_copy_is_a_pipeline_over_two_workers_and_requests_use_both(setup):
    cluster, plan, placed, expected = setup
    d = cluster.devices
    assert plan.replicas == ((d[0], d[1]), (d[2], d[3])) and plan.devices_per_replica == 2
    assert isinstance(placed, ReplicatedModel) and placed.devices == d
    for replica, group in zip(placed.replicas, plan.replicas):
        assert replica.devices == list(group)
        assert {v.device for v in replica.variables} == set(group)
    for p in PROMPTS[:2]:  # compile both copies before the concurrent round
        placed.generate_ids(p, max_new_tokens=16)
    before = dict(placed.served)
    got = concurrently(lambda p: placed.generate_ids(p, max_new_tokens=16), PROMPTS)
    assert got == expected
    served = {k: placed.served[k] - before[k] for k in placed.served}
    assert sorted(served) == [d[0], d[2]] and all(n > 0 for n in served.values()), served


def test_a_lost_worker_drops_only_the_copy_it_held(four_workers, setup):
    cluster, plan, placed, expected = setup
    for p in PROMPTS[:2]:
        placed.generate_ids(p, max_new_tokens=16)
    four_workers.kill(3)  # the second stage of the second copy
    try:
        start = time.monotonic()
        with pytest.warns(ReplicaLostWarning, match="task:2.*task:3"):
            got = concurrently(lambda p: placed.generate_ids(p, max_new_tokens=16), PROMPTS[:4])
        assert time.monotonic() - start < 60
        assert got == {p: expected[p] for p in PROMPTS[:4]}
        assert placed.devices == cluster.devices[:2]
    finally:
        four_workers.restart(3)
        cluster.reconnect()
