"""Connecting this process to a TF cluster: probe first, then tell TensorFlow.

``tf.config.experimental_connect_to_cluster`` returns at once and the first op on an
unreachable worker then hangs with no error (for minutes at least). :func:`connect` therefore
probes every address under a timeout before TensorFlow is told anything, and refuses with one
error naming every worker that did not answer. It also advertises the client's own TF server
at an address the workers can reach back (TF's default is ``localhost``, which breaks clusters
on several hosts), and remembers each worker's *incarnation* so :meth:`Cluster.reconnect` can
tell which workers restarted and which placed state was lost with them.
"""
from __future__ import annotations

import html
import ipaddress
import os
import socket
import threading
import warnings
import weakref
from types import MappingProxyType

from tfnb.cluster.local import LocalCluster, free_ports
from tfnb.cluster.probe import probe_all
from tfnb.cluster.security import (
    ExposedServerWarning,
    client_guard,
    client_guarded,
    is_exposed,
    listening_scope,
    warn_if_exposed,
)
from tfnb.cluster.spec import ClusterSpec, parse_address, parse_spec, split_address
from tfnb.cluster.status import ClusterStatus, gather
from tfnb.errors import ClusterError, NotConnectedError, SpecError, UnreachableError
from tfnb.hooks import workers_stopping

CLIENT_JOB = "tfnb_client"
_lock = threading.RLock()
_current: Cluster | None = None
_told: tuple[ClusterSpec, str] | None = None  # what TensorFlow was last told: spec, client address
_generation = 0  # counts the clusters made current in turn (see generation())


def current(required: bool = True) -> Cluster | None:
    """The cluster this process is connected to (the last :func:`connect`)."""
    if _current is None and required:
        raise NotConnectedError("not connected to a cluster; run tfnb.connect(...) or "
                                "%tfcluster local 2")
    return _current


def generation() -> int:
    """A number that changes whenever another cluster becomes this process's (a connect, or a
    reconnect of a cluster another replaced), and stays through reconnects of the current one.

    Functions the client traced are registered on the workers of the cluster current then;
    TensorFlow registers them again on a worker restarted behind the same cluster when it
    reconnects, not on another cluster's workers, which may have the same device names
    (``tfnb.runtime.graphs`` keeps its shared traces within one generation)."""
    return _generation


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback interface.

    Examples
    --------
    >>> is_loopback("127.0.0.2"), is_loopback("localhost"), is_loopback("10.0.0.1")
    (True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def advertise_host(spec: ClusterSpec) -> str:
    """The client address the workers can reach: loopback for a local cluster, otherwise the
    address of the interface this machine would use to reach the first remote worker."""
    remote = [split_address(a) for a in spec.addresses if not is_loopback(split_address(a)[0])]
    if not remote:
        return "127.0.0.1"
    host, port = remote[0]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:  # UDP connect sends no packet
        s.connect((host, port))
        local = s.getsockname()[0]
    return f"[{local}]" if ":" in local else local


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 < timeout <= 3600:
        raise SpecError(f"timeout={timeout!r}; expected seconds, a number > 0 and <= 3600")
    return float(timeout)


def _unreachable(results, timeout: float) -> UnreachableError:
    bad = [r for r in results if r.state != "up"]
    listed = ", ".join(f"{r.address} ({r.error or r.state})" for r in bad)
    return UnreachableError(f"{len(bad)} of {len(results)} workers did not answer within "
                            f"{timeout:g} s: {listed}; nothing was changed")


class Cluster:
    """A TF cluster this process is connected to. Made by :func:`connect` or :func:`local`.

    Examples
    --------
    >>> cluster = tfnb.local(2)                    # doctest: +SKIP
    >>> cluster.workers                            # doctest: +SKIP
    ['/job:worker/replica:0/task:0', '/job:worker/replica:0/task:1']
    >>> cluster.status()                           # doctest: +SKIP
    """

    def __init__(self, spec: ClusterSpec, *, timeout: float, client_address: str,
                 probes, local: LocalCluster | None = None):
        self.spec = spec
        self.timeout = timeout
        self.client_address = client_address
        self.local = local
        self.started_by_local = False  # set by local(): a later local() may replace it
        self.connected = True
        self._incarnations = {p.address: p.incarnation for p in probes}
        self._devices = [d.name for p in probes for d in p.devices]
        self._holders: list[tuple[weakref.ref, str, frozenset]] = []
        # the connect-time probes already say who is up and what devices there are: no more I/O
        self._last: ClusterStatus = gather(spec, timeout, connected=False, servers=self.servers(),
                                           probes=probes)

    # --- what the cluster has -------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        """Task prefixes, e.g. ``/job:worker/replica:0/task:0``."""
        return [f"/job:{j}/replica:0/task:{i}" for j, i, _ in self.spec.tasks()]

    @property
    def incarnations(self) -> MappingProxyType[str, int]:
        """``{address: incarnation}`` of each worker as last probed (connect or reconnect).

        A read-only copy: a worker whose incarnation changed was restarted and lost its state.
        """
        return MappingProxyType(dict(self._incarnations))

    @property
    def devices(self) -> list[str]:
        """Full TF names of every device of every worker, as reported when connecting."""
        return list(self._devices)

    def servers(self) -> dict[str, str]:
        """``{server: listening scope}`` for the workers tfnb started here and the client's
        server."""
        out = dict(self.local.scopes()) if self.local else {}
        port = split_address(self.client_address)[1]
        out[f"client ({self.client_address})"] = ("loopback (guarded)" if client_guarded(port)
                                                  else listening_scope(port))
        return out

    # --- health ---------------------------------------------------------------------------
    def status(self, timeout: float | None = None) -> ClusterStatus:
        """Per worker: state, round-trip latency, devices and memory. Bounded by ``timeout``."""
        t = self.timeout if timeout is None else _check_timeout(timeout)
        self._last = gather(self.spec, t, connected=self.connected and _current is self,
                            servers=self.servers())
        return self._last

    # --- remote state bookkeeping -----------------------------------------------------------
    def register(self, obj: object, label: str, devices) -> None:
        """Record that ``obj`` (e.g. a placed model) keeps state on ``devices``.

        When a worker restarts, :meth:`reconnect` names it among what must be placed again and
        calls ``obj.on_state_lost(reason)`` if it has that method.
        """
        tasks = frozenset(d.split("/device:")[0] for d in devices)
        self._holders.append((weakref.ref(obj), label, tasks))

    def _lose(self, tasks: set[str] | None, reason: str) -> list[str]:
        lost, keep = [], []
        for ref, label, held in self._holders:
            obj = ref()
            if obj is None:
                continue
            if tasks is None or held & tasks:
                lost.append(label)
                hook = getattr(obj, "on_state_lost", None)
                if hook:
                    hook(reason)
            else:
                keep.append((ref, label, held))
        self._holders = keep
        return lost

    def reconnect(self, timeout: float | None = None, *, only_if_current: bool = False) -> dict:
        """Connect again after workers restarted; returns which restarted and what was lost.

        With ``only_if_current``, a cluster that another ``connect`` replaced is left as it is
        (NotConnectedError): a background caller (a replicated model's healer) must not take the
        process back from a cluster connected since it looked.

        Examples
        --------
        >>> cluster.reconnect()                    # doctest: +SKIP
        {'restarted': ['/job:worker/replica:0/task:1'], 'lost': ['SmolLM2 placed on 2 devices']}
        """
        t = self.timeout if timeout is None else _check_timeout(timeout)
        # one reconnect at a time: a replicated model's healer (tfnb.runtime.replicas) may
        # reconnect from its thread while the user does; the second then finds nothing restarted
        with _lock:
            if only_if_current and _current is not self:
                raise NotConnectedError("another cluster was connected since: this one is "
                                        "not connected again")
            results = probe_all(self.spec.addresses, t)
            if any(r.state != "up" for r in results):
                raise _unreachable(results, t)
            names = dict(zip(self.spec.addresses, self.workers))
            restarted = [names[r.address] for r in results
                         if r.incarnation != self._incarnations.get(r.address)]
            _tell_tensorflow(self.spec, self.client_address)
            _make_current(self)
            if restarted:
                _await_restarted([r.devices[0].name for r in results if names[r.address] in
                                  restarted and r.devices],
                                 [r.devices[0].name for r in results if r.devices], t)
            lost = self._lose(set(restarted), "a worker restarted") if restarted else []
            self._incarnations = {r.address: r.incarnation for r in results}
            self._devices = [d.name for r in results for d in r.devices]
            self.connected = True
        return {"restarted": restarted, "lost": lost}

    # --- ending ---------------------------------------------------------------------------
    def disconnect(self) -> None:
        """Forget this cluster: placed models on it become unusable; workers keep running.

        Profiles of this cluster whose traces are still coming in are given up to 10 s to take
        them in first (``tfnb.profiler.capture.STOP_WAIT_S``), so reading one later needs no
        worker; a trace still on its way after that keeps coming in.

        TensorFlow has no call to drop a remote context; the workers release it when their
        keep-alive expires (600 s) or when another cluster is connected.
        """
        workers_stopping(self.spec.addresses, "the cluster was disconnected", final=False)
        self._forget()

    def _forget(self) -> None:
        global _current
        with _lock:
            self._lose(None, "the cluster was disconnected")
            self.connected = False
            if _current is self:
                _current = None

    def stop(self) -> None:
        """Disconnect and stop the worker processes tfnb started for this cluster.

        Functions and tensors nobody holds any more are released while the workers still
        answer, so TensorFlow does not log a failed remote clean-up for each of them later.
        Profiles of these workers take in the traces still on their way first, and a profiled
        block still running is ended there (see :meth:`LocalCluster.close`): a profile read after
        ``stop()`` is complete, or ``partial`` with a reason saying it was stopped first.

        This process's own TF server, which ``connect`` started, keeps listening: TensorFlow
        cannot stop it, and it ends with the process. If it was guarded (an ``isolate=True``
        cluster), it stays guarded until then. If it is reachable from other hosts and no other
        cluster is connected, an :class:`~tfnb.cluster.security.ExposedServerWarning` says so:
        restart the kernel to close it.
        """
        if self.local is None:  # the workers keep running: as disconnect()
            self.disconnect()
        else:  # LocalCluster.close() takes the traces in (once, with final=True)
            self._forget()
            import gc

            gc.collect()
            self.local.close()
        port = split_address(self.client_address)[1]
        scope = "loopback (guarded)" if client_guarded(port) else listening_scope(port)
        if _current is None and is_exposed(scope):
            warnings.warn(f"this process's own TF server ({self.client_address}) still listens on "
                          f"{scope} after stop(): TensorFlow cannot stop it; it runs any code it "
                          "is sent until this process ends (restart the kernel to close it)",
                          ExposedServerWarning, stacklevel=2)

    close = stop

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- views (no I/O) -------------------------------------------------------------------
    def __repr__(self) -> str:
        state = "connected" if self.connected else "disconnected"
        kind = "local " if self.local else ""
        return f"<tfnb {kind}Cluster {state}: {len(self.workers)} workers {self.spec.addresses}>"

    def _repr_html_(self) -> str:
        return f"<b>{html.escape(repr(self))}</b>" + self._last._repr_html_()


def _await_restarted(devices: list[str], every: list[str], timeout: float) -> None:
    """Run one small op on each restarted worker's device, then hand its result to every other
    worker (``every``: one device per worker), retrying while a channel to it still refuses:
    right after a restart on the same port, the first calls fail with "failed to connect to all
    addresses ... Connection refused" although the worker answered our probe (the old
    connection's failure outlives the process it belonged to), and the other workers' channels
    to it do the same, failing the first generate after reconnect() and place()
    (docs/faults.md)."""
    import time

    import tensorflow as tf
    from tensorflow.python.eager import context

    client_cpu = context.context().host_address_space() + "/device:CPU:0"
    deadline = time.monotonic() + timeout

    def hand_over(src: str, dst: str | None):
        @tf.function
        def run(x):
            with tf.device(src):
                y = tf.identity(x)
            if dst is None:
                return y
            with tf.device(dst):  # dst receives from src: dst's channel to src
                return tf.identity(y)
        return run

    for device in devices:
        for dst in [None] + [d for d in every if d != device]:
            run = hand_over(device, dst)
            while True:
                try:
                    with tf.device(client_cpu):  # a client-side input: the wait frees the GIL
                        x = tf.constant(0)
                    run(x).numpy()
                    break
                except tf.errors.UnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)


def _tell_tensorflow(spec: ClusterSpec, client_address: str) -> None:
    import tensorflow as tf

    from tfnb.cluster.tflog import skip_remote_cleanup_at_exit

    skip_remote_cleanup_at_exit()  # at exit, no "Failed to remove function remotely" per function
    # Remote ops go as unary Enqueue RPCs, not over TF's streaming enqueue: in TF 2.21, after an
    # op failed on a killed worker, the next connect to another cluster can hang for good with
    # streaming (in EagerExecutor::WaitForAllPendingNodes, holding the GIL), and decoding is no
    # slower without it (docs/faults.md). TF's own dynamic-cluster tests turn it off the same
    # way; the variable is read when a connection is made. A value the user set is kept.
    os.environ.setdefault("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE", "0")
    jobs = spec.as_dict()
    jobs[CLIENT_JOB] = [client_address]
    # A ClusterSpec, not a resolver: with a resolver whose master() is "" TF silently does nothing.
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(jobs), job_name=CLIENT_JOB,
                                              task_index=0, make_master_device_default=False)
    tf.config.list_logical_devices()  # initializes the context: the client's server listens


def _make_current(cluster: Cluster) -> None:
    global _current, _generation
    with _lock:
        if _current is not None and _current is not cluster:
            _current._lose(None, "another cluster was connected")
            _current.connected = False
        if _current is not cluster:
            _generation += 1
        _current = cluster


def connect(spec: object = None, *, timeout: float = 5.0, tf_config: bool = False,
            advertise: str | None = None) -> Cluster:
    """Probe every worker, then connect this process to the cluster.

    Parameters
    ----------
    spec : str, dict, path, LocalCluster or TF cluster resolver
        See :func:`tfnb.cluster.spec.parse_spec`.
    timeout : float
        Seconds each worker has to answer; on failure all unreachable workers are named in one
        :class:`~tfnb.errors.UnreachableError` and nothing changes.
    tf_config : bool
        Read the cluster from the ``TF_CONFIG`` environment variable.
    advertise : str, optional
        Host the workers use to reach this client's TF server (default: picked from the route to
        the first remote worker; ``127.0.0.1`` for a local cluster).

    Examples
    --------
    >>> cluster = tfnb.connect("10.0.0.5:2222,10.0.0.6:2222", timeout=5)   # doctest: +SKIP
    >>> cluster = tfnb.connect(tf_config=True)                              # doctest: +SKIP
    """
    global _told
    t = _check_timeout(timeout)
    parsed = parse_spec(spec, tf_config=tf_config)
    if CLIENT_JOB in dict(parsed.jobs):
        raise SpecError(f"job name {CLIENT_JOB!r} is reserved for the client; rename that job")
    results = probe_all(parsed.addresses, t)
    if any(r.state != "up" for r in results):
        raise _unreachable(results, t)
    if advertise is None:
        host = advertise_host(parsed)
    else:
        host = parse_address(f"{advertise}:1").rpartition(":")[0]
    with _lock:
        # The same cluster again keeps the client's address (TF then updates its remote contexts
        # and state on workers that stayed up survives); another cluster makes TF start a new
        # client server, which cannot bind the port the old one still holds.
        if _told is not None and _told[0] == parsed and _told[1].rpartition(":")[0] == host:
            client_address = _told[1]
        else:
            client_address = f"{host}:{free_ports(1)[0]}"
        local = spec if isinstance(spec, LocalCluster) else None
        if local is not None and local.guard is not None:
            # the client's server outlives every cluster: its guard is the process's, not local's
            client_guard().add_ports([split_address(client_address)[1]])
        _tell_tensorflow(parsed, client_address)
        _told = (parsed, client_address)
        cluster = Cluster(parsed, timeout=t, client_address=client_address, probes=results,
                          local=local)
        _make_current(cluster)
    warn_if_exposed(cluster.servers())
    return cluster


def local(n_workers: int = 2, *, timeout: float = 5.0, start_timeout: float = 60.0,
          isolate: bool = False, cpus=None, gpus=None, replace: bool = True) -> Cluster:
    """Start ``n_workers`` TF workers on this machine and connect to them (``cpus``, ``gpus``:
    see :class:`~tfnb.cluster.local.LocalCluster`).

    If the cluster this process is connected to was started by ``local()`` and its workers still
    run (a second ``%tfcluster local``), it is stopped first with a warning that says so; with
    ``replace=False`` a :class:`~tfnb.errors.ClusterError` says it is still running instead.
    Its placed models were lost either way: connecting another cluster ends them. A
    ``LocalCluster`` made by hand and connected stays as it is. The arguments are checked
    before anything is stopped.

    Examples
    --------
    >>> cluster = tfnb.local(2)                    # doctest: +SKIP
    >>> cluster.stop()                             # doctest: +SKIP
    """
    LocalCluster.check_arguments(n_workers, start_timeout, cpus, gpus)
    _check_timeout(timeout)
    prev = _current
    if prev is not None and prev.started_by_local and any(prev.local.alive()):
        what = (f"the local cluster of {len(prev.workers)} workers at "
                f"{', '.join(prev.spec.addresses)}")
        if not replace:
            raise ClusterError(f"{what} is still running; stop it first (cluster.stop() or "
                               "%tfcluster stop), or pass replace=True to stop it here")
        warnings.warn(f"stopping {what} before starting a new one", UserWarning, stacklevel=2)
        prev.stop()
    lc = LocalCluster(n_workers, timeout=start_timeout, isolate=isolate, cpus=cpus, gpus=gpus)
    try:
        cluster = connect(lc, timeout=timeout)
        cluster.started_by_local = True
        return cluster
    except BaseException:
        lc.close()
        raise


__all__ = ["Cluster", "ClusterError", "connect", "current", "local", "is_loopback"]
