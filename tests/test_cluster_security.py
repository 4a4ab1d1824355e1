"""Loopback guards with real nftables tables: one per cluster, and the client's server guarded
until the process ends. Seen from the rule set here; tests/test_netns.py probes from another
host."""
import os
import shutil
import subprocess
import warnings

import pytest

import tfnb
from tfnb.cluster import LocalCluster, security
from tfnb.cluster.probe import probe


def _nft_unavailable() -> str:
    if not shutil.which("nft"):
        return ("the nft command is missing (Debian: apt-get install nftables; scripts/test does "
                "it as root)")
    if os.geteuid() != 0:
        return "nftables tables need root"
    res = subprocess.run(["nft", "-f", "-"],
                         input="add table inet tfnb_probe\ndelete table inet tfnb_probe\n",
                         text=True, capture_output=True, timeout=10)
    if res.returncode != 0:
        return f"nft may not change the rule set here: {res.stderr.strip()[:120]}"
    return ""


_why = _nft_unavailable()
pytestmark = pytest.mark.skipif(bool(_why), reason=f"{_why}; loopback-guard tests need it")


def _table(name: str) -> str:
    """The rules of one table ('' when it does not exist)."""
    res = subprocess.run(["nft", "list", "table", "inet", name], capture_output=True, text=True,
                         timeout=10)
    return res.stdout if res.returncode == 0 else ""


def test_two_isolated_clusters_each_keep_their_guard():
    a, b = LocalCluster(1, isolate=True), LocalCluster(1, isolate=True)
    try:
        ta, tb = a.guard.table, b.guard.table
        assert ta != tb
        assert str(a.ports[0]) in _table(ta) and str(b.ports[0]) in _table(tb)
        a.close()
        assert _table(ta) == ""
        assert str(b.ports[0]) in _table(tb)  # closing one cluster left the other guarded
        assert probe(b.addresses[0], 5).state == "up"
    finally:
        a.close()
        b.close()
    assert _table(tb) == ""


def test_the_client_server_stays_guarded_after_stop():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = tfnb.local(1, isolate=True)
        cluster_table = c.local.guard.table
        port = int(c.client_address.rsplit(":", 1)[1])
        assert set(c.servers().values()) == {"loopback (guarded)"}
        c.stop()
    assert not [w for w in caught if issubclass(w.category, tfnb.ExposedServerWarning)]
    assert _table(cluster_table) == ""  # the workers' table went with them
    client_table = security.client_guard().table
    assert str(port) in _table(client_table)  # TF cannot stop this server: it stays guarded
    assert security.client_guarded(port)
    assert c.servers()[f"client ({c.client_address})"] == "loopback (guarded)"


def test_tables_of_dead_processes_are_removed_by_the_next_guard():
    dead = "tfnb_999999999_1"  # no such pid
    subprocess.run(["nft", "add", "table", "inet", dead], check=True, timeout=10)
    guard = security.LoopbackGuard([1])
    try:
        assert _table(dead) == ""
    finally:
        guard.close()
        subprocess.run(["nft", "delete", "table", "inet", dead], capture_output=True, timeout=10)
