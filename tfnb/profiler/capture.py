"""Capturing TensorFlow's own traces from every worker and from this process while code runs.

Start and stop
--------------
``tf.profiler.experimental.client.trace`` needs its duration up front, which a notebook cell
does not know. Every TF server runs the ``tensorflow.ProfilerService`` gRPC service, which has
``StartContinuousProfiling`` / ``GetSnapshot`` / ``StopContinuousProfiling`` (TF 2.21):

* ``StartContinuousProfiling`` answers once the session is running, so nothing of the block is
  lost, nothing sleeps, and its round trip bounds the clock offset (below). ``Profile`` with a
  long duration + ``Terminate`` gives neither;
* ``GetSnapshot`` returns the XSpace in the reply, so hosts need no shared file system; it
  restarts a session, which ``StopContinuousProfiling`` ends.

Leaving the block sends every target its ``GetSnapshot`` and returns: the window ends there
(``t_end``). The workers convert their traces while this process goes on (:class:`Collection`);
the Profile waits for them when first read. A thread sends ``StopContinuousProfiling`` once each
snapshot is in, and a next capture of the same servers waits for that (a server runs one session
at a time). This process is traced the same way, through its own TF server
(``Cluster.client_address``): the in-process profiler returns trace-viewer events, not an XSpace.
Every RPC has a deadline: a dead or silent worker makes the profile ``partial``, never a hang.

Before tfnb stops or disconnects workers it calls :func:`collect_for` (a
``tfnb.hooks.before_workers_stop`` hook, so the cluster package never imports the profiler): a
profile that traced them takes its traces in then (within :data:`STOP_WAIT_S` for all) and
reads later need no worker; a block still running is stopped there.

Clock alignment: the client notes its clock just before ``StartContinuousProfiling`` (t0) and on
the reply (t1), so a worker's offset is ``start - (t0 + t1) / 2`` within ``(t1 - t0) / 2``.
Offsets within that uncertainty are taken as 0; larger ones are subtracted in build.py.

What a capture costs and where that time goes: see docs/profiling.md.
"""
from __future__ import annotations

import atexit
import threading
import time
import uuid

from tfnb import hooks
from tfnb.cluster.connect import CLIENT_JOB, current
from tfnb.errors import NotConnectedError, ProfileError
from tfnb.profiler.rpc import ProfilerStub, messages, options

HOST_TRACER_LEVEL = 3  # 3 adds the input shapes that transfer sizes are read from (see xplane.py)
_active: set = set()   # captures whose block is running
_pending: set = set()  # stopped captures whose traces are still coming in or sessions ending
STOP_WAIT_S = 10.0     # most seconds stopping or disconnecting workers waits for traces (in all)


def _reason(err) -> str:
    import grpc

    if isinstance(err, (grpc.FutureTimeoutError, TimeoutError)):
        return "did not answer within the capture timeout"
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else str(err)) or ""
    details = details.strip().splitlines()[0][:160] if details.strip() else ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"did not answer (dead or unreachable): {details}"
    if code == grpc.StatusCode.CANCELLED:
        return f"stopped answering (its server went away): {details}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return "has no TF profiler service"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "did not answer within the capture timeout"
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return "another profiling session is already running there"
    return f"{getattr(code, 'name', type(err).__name__)}: {details}"


def _result(future, deadline: float):
    """A gRPC future's reply, waiting at most until ``deadline`` (time.monotonic); its error
    raised."""
    return future.result(timeout=max(0.0, deadline - time.monotonic()))


class Capture:
    """One capture over a cluster's workers and this process; made by :func:`profile`."""

    def __init__(self, cluster, *, timeout: float = 60.0):
        self.timeout = float(timeout)
        self.targets = list(zip(cluster.workers, cluster.spec.addresses))
        if getattr(cluster, "client_address", None):  # this process's own TF server
            self.targets.append(("client", cluster.client_address))
        self.client_task = f"/job:{CLIENT_JOB}/replica:0/task:0"
        self.client_device = f"{self.client_task}/device:CPU:0"
        self.session_id = f"tfnb-{uuid.uuid4().hex[:12]}"
        self.reasons: dict[str, str] = {}
        self.started: dict[str, tuple] = {}   # task -> (stub, t0, t1)
        self.t_begin = self.t_end = 0
        self.addresses = {a for _, a in self.targets}
        self._collection: Collection | None = None

    def start(self) -> None:
        """Start a session on every target at once; returns when each has answered (or failed)."""
        limit = min(self.timeout, 10.0)
        addresses = {a for _, a in self.targets}
        for prior in list(_pending):  # a server runs one session at a time: let earlier ones end
            if prior.addresses & addresses:
                prior.wait_finished(limit)
        req = messages()["ProfileRequest"](opts=options(0, host_level=HOST_TRACER_LEVEL),
                                           emit_xspace=True, session_id=self.session_id,
                                           duration_ms=0)
        calls = []
        for task, address in self.targets:
            stub, replied = ProfilerStub(address), []
            t0 = time.time_ns()
            fut = stub.start_continuous.future(req, timeout=limit)
            # t1: the reply's arrival
            fut.add_done_callback(lambda f, r=replied: r.append(time.time_ns()))
            calls.append((task, address, stub, t0, fut, replied))
        deadline = time.monotonic() + limit + 1.0
        for task, address, stub, t0, fut, replied in calls:
            try:
                _result(fut, deadline)
            except Exception as e:  # noqa: BLE001 - reported per target
                fut.cancel()
                stub.close()
                self.reasons[task] = f"{address} {_reason(e)}"
            else:
                self.started[task] = (stub, t0, replied[0] if replied else time.time_ns())
        _active.add(self)
        self.t_begin = time.time_ns()

    def stop(self) -> Collection:
        """End the trace window now; the traces follow in the background (see :class:`Collection`).
        A second call (the block ending after its workers were stopped) returns the same one."""
        if self._collection is None:
            self.t_end = time.time_ns()
            _active.discard(self)
            empty = messages()["Empty"]
            calls = {task: (stub, stub.snapshot.future(empty(), timeout=self.timeout), t01)
                     for task, (stub, *t01) in self.started.items()}
            self.started = {}
            self._collection = Collection(self, calls)
        return self._collection


class Collection:
    """The traces of a stopped capture, on their way here: what :class:`~tfnb.profiler.Profile`
    reads when first used. Every target was sent its ``GetSnapshot`` when the block ended, so
    each worker converts its trace while this process goes on; :meth:`result` waits for them (at
    most the capture's timeout, then the missing ones are reasons), and a background thread ends
    the sessions (``GetSnapshot`` restarts one) and closes the channels whether or not anybody
    reads the profile."""

    def __init__(self, cap: Capture, calls: dict):
        self.t_begin, self.t_end = cap.t_begin, cap.t_end
        self.timeout = cap.timeout
        self.address = dict(cap.targets)
        self.addresses = set(self.address.values())
        self._base = {"reasons": dict(cap.reasons), "t_begin": cap.t_begin, "t_end": cap.t_end,
                      "workers": [t for t, _ in cap.targets if t != "client"],
                      "client_device": cap.client_device}
        self._client_task = cap.client_task
        self._calls = calls  # task -> (stub, GetSnapshot future, (t0, t1))
        self._deadline = time.monotonic() + cap.timeout + 1.0  # past every RPC's own deadline
        self._raw: dict | None = None
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._empty = messages()["Empty"]
        _pending.add(self)
        threading.Thread(target=self._finish, name="tfnb-profile-stop", daemon=True).start()

    def _finish(self) -> None:
        try:
            for _stub, fut, _ in self._calls.values():
                try:
                    _result(fut, self._deadline)
                except Exception:  # noqa: BLE001 - result() reports it
                    pass
            limit = min(self.timeout, 5.0)
            stops = [stub.stop_continuous.future(self._empty(), timeout=limit)
                     for stub, _, _ in self._calls.values()]
            end = time.monotonic() + limit + 1.0
            for f in stops:
                try:
                    _result(f, end)
                except Exception:  # noqa: BLE001 - the trace is what matters
                    pass
        finally:
            for stub, _, _ in self._calls.values():
                stub.close()
            _pending.discard(self)
            self._finished.set()

    def wait_finished(self, seconds: float) -> bool:
        """Wait until every session has ended (or ``seconds`` passed)."""
        return self._finished.wait(seconds)

    def result(self) -> dict:
        """The raw material of a Profile (waits for the traces, bounded by the timeout):
        ``spaces`` maps each host to (task, serialized XSpace, (t0, t1) around its start)."""
        return self._take()

    def settle(self, deadline: float, why: str, final: bool) -> bool:
        """Wait until ``deadline`` (time.monotonic) at most for the traces, then hold them (what
        :meth:`result` returns from then on). With ``final`` (the workers are going away) a trace
        not in by then is given up: its host gets a reason that ends "before {why}". Without it,
        nothing is given up, and the traces are held only if all came in. Whether all came in."""
        start, end = time.monotonic(), min(deadline, self._deadline)
        for _, fut, _ in self._calls.values():
            try:
                _result(fut, end)
            except Exception:  # noqa: BLE001 - result() reports it
                pass
        done = all(fut.done() for _, fut, _ in self._calls.values())
        if done:
            self._take()
        elif final:
            self._take(f"did not hand back its trace before {why} "
                       f"(waited {time.monotonic() - start:.2g} s)")
        return done

    def _take(self, cutoff: str | None = None) -> dict:
        with self._lock:
            if self._raw is None:
                spaces, reasons = {}, dict(self._base["reasons"])
                for task, (_, fut, t01) in self._calls.items():
                    if cutoff is not None and not fut.done():
                        fut.cancel()
                        reasons[task] = f"{self.address[task]} {cutoff}"
                        continue
                    try:
                        data = _result(fut, self._deadline).xspace
                    except Exception as e:  # noqa: BLE001 - reported per target
                        reasons[task] = f"{self.address[task]} {_reason(e)}"
                    else:
                        who = self._client_task if task == "client" else task
                        spaces[task] = (who, data, tuple(t01))
                self._raw = {**self._base, "spaces": spaces, "reasons": reasons}
            return self._raw


def collect_for(addresses, why: str, final: bool = True, seconds: float | None = None) -> None:
    """Take in the traces of every stopped profile that traced a worker at one of ``addresses``
    before those workers go away (``final``) or their cluster is disconnected (not ``final``);
    with ``final``, a block still running on them is stopped first. Waits at most ``seconds``
    (default :data:`STOP_WAIT_S`, and never past a capture's own timeout) for all together, with
    the GIL released. Installed as a ``tfnb.hooks.before_workers_stop`` hook.

    Examples
    --------
    >>> with tfnb.profiler.profile(cluster) as prof:                        # doctest: +SKIP
    ...     chain(x)
    >>> collect_for(cluster.spec.addresses, "the cluster was stopped")     # doctest: +SKIP
    >>> cluster.local.close(); prof.partial                                # doctest: +SKIP
    False
    """
    addresses = set(addresses)
    deadline = time.monotonic() + (STOP_WAIT_S if seconds is None else float(seconds))
    if final:
        for cap in list(_active):
            if cap.addresses & addresses:
                cap.stop()
    for coll in list(_pending):
        if coll.addresses & addresses:
            if coll.settle(deadline, why, final) and final:  # the sessions end in a few ms
                coll.wait_finished(max(0.0, deadline - time.monotonic()))


hooks.before_workers_stop.append(collect_for)


@atexit.register
def _stop_all() -> None:
    """Leave no server tracing after this process: every running block is stopped and each
    session ended once its trace is in, at most the capture's timeout + 7 s. (Local workers are
    closed by their own atexit, which collects first too, whichever of the two runs first.)"""
    for cap in list(_active):
        try:
            cap.stop()
        except Exception:  # noqa: BLE001 - at exit: one failed stop must not keep the others
            pass
    for coll in list(_pending):  # bounded by each capture's timeout (its RPCs' deadlines)
        coll.wait_finished(max(0.0, coll._deadline - time.monotonic()) + 7.0)


def resolve_cluster(cluster):
    """The cluster to profile: the given one, else the connected one; ProfileError if none."""
    if cluster is None:
        try:
            cluster = current()
        except NotConnectedError:
            raise ProfileError("not connected to a cluster; run tfnb.local(2), tfnb.connect(...) "
                               "or %tfcluster first") from None
    if not getattr(cluster, "connected", False):
        raise ProfileError(f"cluster {cluster!r} is not connected; connect it again before "
                           "profiling")
    return cluster


def check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 < timeout <= 3600:
        raise ProfileError(f"timeout={timeout!r}; expected seconds, a number > 0 and <= 3600")
    return float(timeout)
