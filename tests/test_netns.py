"""Several hosts on one machine (network namespaces): a multi-host cluster, a cut link, and the
loopback guard seen from another host."""
import json
import subprocess
import sys
import threading
import time
import warnings

import pytest

import tfnb
from tfnb.cluster import LocalCluster
from tfnb.cluster.probe import probe

from .netns import Hosts, unavailable

_why = unavailable()
pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(bool(_why), reason=f"{_why}; multi-host tests need it")]


@pytest.fixture(scope="module")
def hosts():
    h = Hosts(3)
    yield h
    h.close()


def _probe_from(hosts, i, address, timeout=2.0):
    code = f"from tfnb.cluster.probe import probe; print(probe({address!r}, {timeout}).state)"
    res = hosts.run(i, [sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return res.stdout.strip()


@pytest.fixture(scope="module")
def remote_workers(hosts):
    spec = {"worker": [f"{a}:2222" for a in hosts.addresses[:2]]}
    procs = [hosts.popen(i, [sys.executable, "-m", "tfnb.cli", "worker",
                             "--cluster", json.dumps(spec), "--task", str(i)],
                         stdout=subprocess.PIPE, text=True) for i in range(2)]
    lines = {}
    readers = [threading.Thread(target=lambda i=i, p=p: lines.__setitem__(i, p.stdout.readline()),
                                daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(60)
    try:
        assert all(lines.get(i, "").startswith("TFNB_READY") for i in range(2)), lines
        yield spec
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def test_workers_on_two_hosts_compute_together_and_reach_the_client(hosts, remote_workers):
    import tensorflow as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = tfnb.connect(remote_workers, timeout=3)
    # the client's TF server is advertised on the bridge, not as 'localhost'
    assert cluster.client_address.startswith(f"{hosts.gateway}:")
    assert _probe_from(hosts, 0, cluster.client_address) == "up"
    w0, w1 = (f"{t}/device:CPU:0" for t in cluster.workers)

    @tf.function
    def across(x):
        with tf.device(w0):
            y = tf.matmul(x, x)
        with tf.device(w1):
            return tf.reduce_sum(y)

    assert float(across(tf.ones([4, 4]))) == 64.0
    assert cluster.status(timeout=2).all_up


def test_a_cut_link_shows_unresponsive_within_the_timeout(hosts, remote_workers):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = tfnb.connect(remote_workers, timeout=3)
    hosts.cut(0)
    try:
        start = time.monotonic()
        st = cluster.status(timeout=2.0)
        assert time.monotonic() - start < 2.0 + 1.0
        assert st.states == {f"{hosts.addresses[0]}:2222": "unresponsive",
                             f"{hosts.addresses[1]}:2222": "up"}
    finally:
        hosts.mend(0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not cluster.status(timeout=2).all_up:
        time.sleep(0.5)
    assert cluster.status(timeout=2).all_up


def test_loopback_guard_hides_a_local_cluster_from_other_hosts(hosts):
    open_lc, guarded = LocalCluster(1), LocalCluster(1, isolate=True)
    try:
        # Without the guard another host reaches the worker: TF binds every interface.
        assert _probe_from(hosts, 2, f"{hosts.gateway}:{open_lc.ports[0]}") == "up"
        assert _probe_from(hosts, 2, f"{hosts.gateway}:{guarded.ports[0]}") == "unresponsive"
        assert probe(guarded.addresses[0], 2).state == "up"  # loopback still works
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            cluster = tfnb.connect(guarded)
        client = f"{hosts.gateway}:{cluster.client_address.rsplit(':', 1)[1]}"
        assert _probe_from(hosts, 2, client) == "unresponsive"  # the client's server is guarded too
        assert set(cluster.servers().values()) == {"loopback (guarded)"}
        table = guarded.guard.table
    finally:
        open_lc.close()
        guarded.close()
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                            timeout=10).stdout
    assert table not in tables
    # TF cannot stop this process's own server: it stays guarded after its cluster closed
    assert _probe_from(hosts, 2, client) == "unresponsive"


def test_each_host_reads_its_own_copy_of_the_model(hosts, remote_workers, tmp_path):
    """Two hosts, two copies of a small GGUF at paths of their own: each worker reads its stages
    from its copy (the same tokens as weights sent from the client); a host whose copy differs
    is refused before anything is placed; one without a copy is sent its weights. (The
    namespaces share this machine's files: each host's copy is its own by its path.)"""
    import shutil

    from tfnb.errors import PlacementError
    from tfnb.models import decoder

    from tests.test_packed import PROMPTS, write_quantized_gguf

    config = decoder.tiny_config(n_layers=2)
    mine = tmp_path / "client" / "m.gguf"
    mine.parent.mkdir()
    write_quantized_gguf(mine, config, decoder.random_weights(config, 7),
                         {"embed": "Q8_0", "attn": "Q4_0", "ffn": "Q4_1"})
    copies = [tmp_path / f"host{i}" / "model.gguf" for i in range(2)]
    for copy in copies:
        copy.parent.mkdir()
        shutil.copy(mine, copy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = tfnb.connect(remote_workers, timeout=3)
    try:
        model = tfnb.load_model(mine, progress=False)
        devices = [f"{t}/device:CPU:0" for t in cluster.workers]
        files = {"worker:0": copies[0], "worker:1": copies[1]}
        read = tfnb.place(model, devices, cluster, files=files)
        assert read.weight_sources == {"worker:0": f"read {copies[0]}",
                                       "worker:1": f"read {copies[1]}"}
        sent = tfnb.place(model, devices, cluster, files=False)
        assert read.generate_ids(PROMPTS, max_new_tokens=6) == \
            sent.generate_ids(PROMPTS, max_new_tokens=6)
        data = bytearray(copies[1].read_bytes())
        data[data.index(b"tiny")] = ord("T")  # another model name: the same size, another header
        copies[1].write_bytes(bytes(data))
        with pytest.raises(PlacementError, match=rf"worker:1's '{copies[1]}' has the same size"):
            tfnb.place(model, devices, cluster, files=files)
        partly = tfnb.place(model, devices, cluster, files={**files, "worker:1": None})
        assert partly.weight_sources == {"worker:0": f"read {copies[0]}",
                                         "worker:1": "sent from the client"}
        assert partly.generate_ids(PROMPTS, max_new_tokens=6) == \
            sent.generate_ids(PROMPTS, max_new_tokens=6)
    finally:  # the module's workers stop after it: later tests must not find them current
        cluster.disconnect()
