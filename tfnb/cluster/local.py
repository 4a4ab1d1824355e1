"""N TensorFlow worker processes on this machine, on 127.0.0.1 with free ports.

Workers are stopped on :meth:`LocalCluster.close`, at interpreter exit (kernel shutdown), and when
the parent dies in any way: each worker watches a pipe from the parent and its parent's pid (see
``worker.py``). :meth:`LocalCluster.close` leaves nothing behind: no process, no pipe, no status
file, no log folder, no nftables table.
"""
from __future__ import annotations

import atexit
import json
import numbers
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from tfnb.cluster.probe import probe_all
from tfnb.cluster.spec import ClusterSpec, split_address
from tfnb.cluster.worker import READY, status_path
from tfnb.errors import ClusterError, SpecError
from tfnb.hooks import workers_stopping

_live: weakref.WeakSet[LocalCluster] = weakref.WeakSet()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago on ``host``."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _per_worker(value, n: int, name: str, parse, one: str) -> list[str | None]:
    """One ``tfnb worker`` flag value (or None) per worker, each checked by ``parse`` now rather
    than in a worker's log: ``value`` is None, one value for every worker (a string or an
    integer), or a list with one entry (or None) per worker; ``one`` shows a value for all."""
    per = [value] * n if value is None or isinstance(value, (str, numbers.Integral)) \
        else list(value)
    if len(per) != n:
        raise SpecError(f"{name}={value!r} has {len(per)} entries for {n} workers: expected one "
                        f"value such as {one} for all, or one entry per worker")
    for v in per:
        if v is not None:
            try:
                parse(v)
            except ValueError as e:
                raise SpecError(str(e)) from None
    return [None if v is None else str(v) for v in per]


def _worker_cpus(cpus, n: int) -> list[str | None]:
    """``--cpus`` of each worker (``tfnb worker``)."""
    from tfnb.cluster.worker import parse_cpus

    return _per_worker(cpus, n, "cpus", parse_cpus, "'0-3'")


def _worker_gpus(gpus, n: int) -> list[str | None]:
    """``--gpu`` of each worker: an index, ``"0,1"`` or ``"none"`` (``tfnb worker``)."""
    from tfnb.cluster.worker import parse_gpus

    return _per_worker(gpus, n, "gpus", parse_gpus, "0")


class LocalCluster:
    """Start ``n_workers`` TF worker servers on this machine and wait until each answers.

    Parameters
    ----------
    n_workers : int
        Number of worker processes (1 to 64).
    timeout : float
        Seconds to wait for all workers to answer; on expiry all are stopped and an error names
        the slow ones with the end of their log.
    isolate : bool
        Install a :class:`~tfnb.cluster.security.LoopbackGuard` so the workers (and later the
        client's server) are unreachable from other hosts. Linux, root and nftables.
    host : str
        Address the workers are advertised at; loopback by default.
    cpus : str or list, optional
        CPUs to pin workers to (``tfnb worker --cpus``): one list such as ``"0-3"`` for every
        worker, or one entry (a list or None) per worker, e.g. ``[None, "1"]`` makes worker 1 a
        one-core machine.
    gpus : int, str or list, optional
        GPUs each worker uses (``tfnb worker --gpu``): one value for every worker, or one entry
        per worker, e.g. ``[0, 1]`` for one worker per GPU; memory grows as used, so workers
        may share a GPU. Default: each worker sees what TensorFlow finds.

    Examples
    --------
    >>> with LocalCluster(2) as lc:          # doctest: +SKIP
    ...     print(lc.spec.addresses)
    ['127.0.0.1:40123', '127.0.0.1:40124']
    """

    @staticmethod
    def check_arguments(n_workers, timeout, cpus, gpus=None) -> tuple[list, list]:
        """SpecError naming the first bad argument; each worker's ``--cpus`` and ``--gpu``
        otherwise."""
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) \
                or not 1 <= n_workers <= 64:
            raise SpecError(f"n_workers={n_workers!r}; expected an integer from 1 to 64")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise SpecError(f"timeout={timeout!r}; expected a number of seconds > 0")
        return _worker_cpus(cpus, n_workers), _worker_gpus(gpus, n_workers)

    def __init__(self, n_workers: int = 2, *, timeout: float = 60.0, isolate: bool = False,
                 host: str = "127.0.0.1", job: str = "worker", cpus=None, gpus=None):
        self.cpus, self.gpus = self.check_arguments(n_workers, timeout, cpus, gpus)
        self.timeout = float(timeout)
        self.log_dir = Path(tempfile.mkdtemp(prefix="tfnb-local-"))
        self.procs: list[subprocess.Popen] = []
        self.info: list[dict] = []
        self.guard = None
        ports = free_ports(n_workers, host)
        self.spec = ClusterSpec(((job, tuple(f"{host}:{p}" for p in ports)),))
        _live.add(self)
        try:
            if isolate:
                from tfnb.cluster.security import LoopbackGuard
                self.guard = LoopbackGuard(ports)
            self._start()
        except BaseException:
            self.close()
            raise

    def _spawn(self, task: int) -> subprocess.Popen:
        job, _, _ = self.spec.tasks()[task]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
        cmd = [sys.executable, "-m", "tfnb.cluster.worker", "--cluster", self.spec.to_json(),
               "--job", job, "--task", str(task), "--watch-stdin", "--parent-pid", str(os.getpid())]
        if self.cpus[task] is not None:
            cmd += ["--cpus", self.cpus[task]]
        if self.gpus[task] is not None:
            cmd += ["--gpu", self.gpus[task]]
        with open(self.log_dir / f"worker-{task}.log", "ab") as log:
            return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                    env=env, start_new_session=True)

    def _await_ready(self, tasks: list[int]) -> dict[int, dict]:
        """Wait (bounded) for each task's ready line and a successful probe; fail naming the
        rest."""
        ready: dict[int, dict] = {}
        readers = [threading.Thread(target=self._read_ready, args=(i, self.procs[i], ready),
                                    daemon=True)
                   for i in tasks]
        for t in readers:
            t.start()
        deadline = time.monotonic() + self.timeout
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
        missing = [i for i in tasks if i not in ready]
        if not missing:  # a printed line is not enough: the server must answer an RPC
            left = max(1.0, deadline - time.monotonic())
            results = probe_all([self.spec.addresses[i] for i in tasks], left)
            missing = [i for i, r in zip(tasks, results) if r.state != "up"]
        if missing:
            self._fail(missing)
        return ready

    def _start(self) -> None:
        _build_packed_ops()
        self.procs = [self._spawn(task) for task in range(len(self.spec.addresses))]
        ready = self._await_ready(list(range(len(self.procs))))
        self.info = [ready[i] for i in range(len(self.procs))]

    @staticmethod
    def _read_ready(i: int, proc: subprocess.Popen, ready: dict) -> None:
        try:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith(READY):
                    ready[i] = json.loads(line[len(READY):])
                    break
        except (OSError, ValueError):  # the pipe was closed: the worker was stopped
            return
        # keep draining so a chatty worker never blocks on a full pipe
        threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()

    def _fail(self, missing: list[int]) -> None:
        tails = {}
        for i in missing:  # read before close() removes the logs
            try:
                log = (self.log_dir / f"worker-{i}.log").read_text(errors="replace")
            except OSError:
                log = ""
            tails[i] = log.strip().splitlines()[-3:]
        self.close()
        details = []
        for i in missing:
            tail = tails[i]
            code = self.procs[i].poll()
            why = f"exited with code {code}" if code is not None \
                else f"no answer within {self.timeout:g} s"
            details.append(f"worker {i} ({self.spec.addresses[i]}) {why}"
                           + (f": {' | '.join(tail)}" if tail else ""))
        raise ClusterError("local cluster did not start; " + "; ".join(details))

    @property
    def addresses(self) -> list[str]:
        return self.spec.addresses

    @property
    def ports(self) -> list[int]:
        return [split_address(a)[1] for a in self.spec.addresses]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def scopes(self) -> dict[str, str]:
        """``{"worker 0 (127.0.0.1:p)": listening scope}`` for each worker."""
        guarded = self.guard is not None
        return {f"worker {i} ({a})": ("loopback (guarded)" if guarded
                                      else info.get("listening", "unknown"))
                for i, (a, info) in enumerate(zip(self.spec.addresses, self.info))}

    def kill(self, task: int, sig: int = 9) -> None:
        """Send ``sig`` to one worker (fault injection in tests and tutorials)."""
        os.kill(self.procs[task].pid, sig)

    def restart(self, task: int) -> None:
        """Start worker ``task`` again on its old address (after it died or was killed); the old
        process's pipes are closed."""
        proc = self.procs[task]
        if proc.poll() is None:
            workers_stopping([self.spec.addresses[task]], f"worker {task} was restarted",
                             final=True)
            proc.kill()
        proc.wait(10)
        _close_pipes(proc)
        self.procs[task] = self._spawn(task)
        self.info[task] = self._await_ready([task])[task]

    def close(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after 5 s), close their pipes, remove their
        status files, the log folder and the guard. Safe to call more than once.

        Profiles of these workers whose traces are still coming in take them in first (at most
        ``tfnb.profiler.capture.STOP_WAIT_S`` seconds, 10 by default; see ``tfnb.hooks``)."""
        self._close("the cluster was stopped")

    def _close(self, why: str) -> None:
        if any(p.poll() is None for p in self.procs):
            workers_stopping(self.spec.addresses, why, final=True)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            _close_pipes(p)
        for (job, task, address) in self.spec.tasks():  # a killed worker could not remove its own
            try:
                os.unlink(status_path(job, task, split_address(address)[1]))
            except OSError:
                pass
        shutil.rmtree(self.log_dir, ignore_errors=True)
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        _live.discard(self)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        up = sum(self.alive())
        return f"LocalCluster({len(self.procs)} workers, {up} running, {self.spec.addresses})"


def _drain(stream) -> None:
    try:
        for _ in stream:
            pass
    except (OSError, ValueError):  # closed by close() or restart()
        pass


def _build_packed_ops() -> None:
    """Build tfnb's packed-weight ops once here, before the workers load them: N workers
    building at once would each take the compile time (tens of seconds) out of their start-up
    deadline. Without a compiler the workers say so themselves."""
    from tfnb import kernels

    try:
        kernels.build()
    except kernels.KernelBuildError:
        pass


def _close_pipes(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        if stream:
            try:
                stream.close()
            except OSError:  # a broken pipe to a dead worker
                pass


@atexit.register
def _close_all() -> None:
    for lc in list(_live):
        lc._close("this process exited")
