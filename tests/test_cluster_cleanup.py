"""Nothing left behind: processes, pipes, status files, log folders; a second local cluster; a
worker whose parent died; status files private and checked."""
import json
import os
import signal
import stat
import subprocess
import sys
import time
import warnings

import pytest

import tfnb
from tfnb.cluster import LocalCluster, worker
from tfnb.cluster.status import parse_status_file
from tfnb.errors import ClusterError, StatusFileError

from .test_cluster import _gone


def _wait_for(path: str, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.1)
    return False


def _status_file(lc: LocalCluster, task: int = 0) -> str:
    return worker.status_path("worker", task, lc.ports[task])


def test_close_leaves_no_process_pipe_status_file_or_log_folder():
    lc = LocalCluster(1)
    path, proc = _status_file(lc), lc.procs[0]
    assert _wait_for(path)
    folder = os.lstat(os.path.dirname(path))
    assert stat.S_ISDIR(folder.st_mode) and stat.S_IMODE(folder.st_mode) == 0o700
    assert folder.st_uid == os.getuid()
    assert lc.log_dir.is_dir()
    lc.close()
    assert proc.poll() is not None
    assert proc.stdin.closed and proc.stdout.closed
    assert not os.path.exists(path)
    assert not lc.log_dir.exists()
    lc.close()  # twice is fine


def test_a_killed_workers_status_file_is_removed_on_close():
    lc = LocalCluster(1)
    path = _status_file(lc)
    assert _wait_for(path)
    lc.kill(0, signal.SIGKILL)  # it cannot remove its own file
    assert _gone(lc.pids[0], 5)
    assert os.path.exists(path)
    lc.close()
    assert not os.path.exists(path)


def test_a_worker_stopped_by_sigterm_removes_its_status_file():
    lc = LocalCluster(1)
    try:
        path = _status_file(lc)
        assert _wait_for(path)
        lc.kill(0, signal.SIGTERM)
        assert _gone(lc.pids[0], 10)
        assert not os.path.exists(path)
    finally:
        lc.close()


def _pipes() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
        except OSError:
            pass
    return n


def test_restart_closes_the_old_workers_pipes():
    lc = LocalCluster(1)
    try:
        old = lc.procs[0]
        lc.restart(0)
        pipes = _pipes()
        assert old.stdin.closed and old.stdout.closed
        lc.restart(0)
        lc.restart(0)
        assert _pipes() <= pipes  # two more restarts, no more open pipes
        assert lc.alive() == [True]
    finally:
        lc.close()


def test_a_second_local_cluster_stops_the_first_or_says_it_still_runs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfnb.ExposedServerWarning)
        first = tfnb.local(1)
        pid = first.local.pids[0]
        with pytest.raises(ClusterError, match="still running.*stop it first"):
            tfnb.local(1, replace=False)
        assert first.local.alive() == [True] and tfnb.current() is first
        with pytest.warns(UserWarning,
                          match=r"stopping the local cluster of 1 workers at 127\.0\.0\.1:"):
            second = tfnb.local(1)
    try:
        assert _gone(pid, 10) and not first.connected
        assert tfnb.current() is second and second.status(timeout=5).all_up
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfnb.ExposedServerWarning)
            second.stop()


def test_stop_warns_that_this_process_server_still_listens():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfnb.ExposedServerWarning)
        c = tfnb.local(1)
    port = c.client_address.rsplit(":", 1)[1]
    with pytest.warns(tfnb.ExposedServerWarning, match=f"{port}.*still listens on all interfaces"):
        c.stop()
    assert tfnb.current(required=False) is None


_PARENT_WITH_FORK = """
import os, sys, time
from tfnb.cluster import LocalCluster
lc = LocalCluster(1)
child = os.fork()
if child == 0:  # keeps every pipe of the parent open, as a forked helper of a notebook would
    time.sleep(60)
    os._exit(0)
print(lc.pids[0], child, flush=True)
time.sleep(120)
"""


def test_a_worker_exits_when_its_parent_dies_even_if_the_pipe_stays_open():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT_WITH_FORK], stdout=subprocess.PIPE,
                              text=True)
    helper = None
    try:
        line = parent.stdout.readline()
        pid, helper = (int(x) for x in line.split())
        assert not _gone(pid, 1.0)
        parent.kill()
        parent.wait(10)
        # the forked helper still holds the worker's stdin: only the parent-pid check ends it
        assert not _gone(helper, 0.1)
        assert _gone(pid, 5)
    finally:
        parent.kill()
        if helper:
            try:
                os.kill(helper, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_status_folder_must_be_private(tmp_path, monkeypatch):
    folder = tmp_path / "tfnb-status"
    monkeypatch.setattr(worker, "status_dir", lambda uid=None: str(folder))
    assert worker.private_status_dir() == str(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.chmod(0o777)  # anyone could swap the files in it
    with pytest.raises(PermissionError, match=str(folder)):
        worker.private_status_dir()
    folder.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match=str(folder)):
        worker.private_status_dir()


@pytest.mark.parametrize("text, names", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "holds list"),
    ('{"host_ram_total": "lots"}', "host_ram_total='lots'"),
    ('{"gpus": [{"device": 3}]}', "gpus entry"),
])
def test_a_malformed_status_file_is_one_error_naming_the_file(text, names):
    with pytest.raises(StatusFileError, match=f"status file /tmp/x.json of /job:worker.*{names}"):
        parse_status_file("/tmp/x.json", text, "/job:worker/replica:0/task:0")


def test_status_reports_a_malformed_status_file_of_a_real_worker(cluster, local_workers):
    path = _status_file(local_workers, 1)
    assert _wait_for(path)
    for _ in range(3):  # the worker rewrites it every 2 s: write garbage just before reading
        with open(path, "w") as f:
            f.write("{garbage")
        try:
            cluster.status(timeout=5)
        except StatusFileError as e:
            assert path in str(e) and "task:1" in str(e) and "not JSON" in str(e)
            break
    else:
        pytest.fail("status() read the garbage three times without an error")
    deadline = time.monotonic() + 10  # and the worker's next write mends it
    while time.monotonic() < deadline:
        try:
            st = cluster.status(timeout=5)
            break
        except StatusFileError:
            time.sleep(0.5)
    assert st.all_up and json.loads(open(path).read())["pid"] == local_workers.pids[1]
