"""Full copies of a model on several devices, with each request sent to the least loaded one.

What ``tf.distribute.MirroredStrategy`` does for training, for serving: every replica device
holds the whole model, so independent requests run on different workers at the same time. A
copy too large for one device runs as a pipeline over a group of them (a hybrid plan: each
replica is then a split placement, its stages overlapping as any split placement's do). A
request (one ``generate`` call) runs on one replica from start to end; concurrent callers
(threads, background cells) are spread over the replicas by the number of requests each has in
flight, and queue on a replica only when every replica is busy.

Each replica is registered with the cluster on its own, so a worker restart marks only the
replicas it held as lost. A replica whose worker is lost is dropped with a
:class:`ReplicaLostWarning` and the others keep serving. A request that was running on it goes
on on another replica from where it stopped, streams included: its prompt plus the tokens made
so far become the new prompt, with what is left of its budget and the same sampling
(``GenerateSession.failover``), so its caller sees one uninterrupted run, with the tokens a run
without the fault gives. It has one try per replica, and a few more, spaced out, for the
moments after a loss when a surviving replica's call fails too though its workers answer. With
no replica left, a request fails with ``WorkerLostError``.

A lost copy rejoins (healing, on unless ``heal(False)``): a background thread notices its workers
answering again (restarted on the same address), reconnects the cluster, places the copy anew
from the client on the same devices, warms it as the copies were warmed, and puts it back in
rotation with a :class:`ReplicaRestoredWarning`. The same holds for a model of one copy (a split
placement served by the endpoint): while it is down, requests fail with ``WorkerLostError``.

Examples
--------
>>> plan = tfnb.plan(model, cluster, mode="replicate")      # doctest: +SKIP
>>> placed = tfnb.place(model, plan, cluster)               # doctest: +SKIP
>>> placed.generate(["Hi", "Hello"])                        # doctest: +SKIP
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref

from tfnb.errors import NotConnectedError, WorkerLostError
from tfnb.names import short_device
from tfnb.runtime.faults import PROBE_TIMEOUT_S, call_with_deadline
from tfnb.runtime.placed import PlacedModel, serving_summary, warm_up
from tfnb.runtime.requests import with_options_signature
from tfnb.shutdown import exiting, start_thread

__all__ = ["ReplicatedModel", "ReplicaLostWarning", "ReplicaRestoredWarning"]

SPARE_TRIES = 4   # a request's retries after failures that left their replica serving
SETTLE_S = 0.25   # the pause before the first of them; doubled before each next one

HEAL_EVERY_S = 1.0     # how often the healer looks at the copies and probes their workers
HEAL_CALL_S = 120.0    # the bound of each cluster call the healer makes (reconnect, placing)
# How long a restored copy warms before it takes requests; the shapes left compile between its
# requests (each request waits for at most the one shape compiling). SmolLM2's 20 shapes took
# 83 s on a quiet worker and over 120 s beside a copy serving 8 clients (bench_soak.py): waiting
# for all of them kept the copy out for minutes.
HEAL_WARM_S = 20.0
HEAL_BACKOFF_S = 30.0  # the longest pause before trying again to restore a copy


class ReplicaLostWarning(UserWarning):
    """A replica of a replicated model lost its worker and no longer takes requests."""


class ReplicaRestoredWarning(UserWarning):
    """A lost replica was placed again on its restarted workers and takes requests again."""


class _Tries:
    """What a request has left of its tries (see ``ReplicatedModel._next_copy``)."""

    def __init__(self, copies: int):
        self.left, self.spare = copies, SPARE_TRIES


class _Copy:
    """One copy's place in the rotation: its current placement and what happened to it.

    ``state``: ``serving``, ``lost`` (its workers are gone, or back but not yet tried) or
    ``restoring`` (being placed and warmed again); times are ``time.time()``."""

    def __init__(self, replica: PlacedModel):
        self.replica, self.state = replica, "serving"
        self.lost_at = self.restored_at = None
        self.heal_error: str | None = None
        self.tries, self.next_try = 0, 0.0


class ReplicatedModel:
    """Replicas (``PlacedModel``s holding the whole model, one per device) behind one API.

    Attributes
    ----------
    replicas : list of PlacedModel
        The replicas still serving, in device order.
    served : dict
        Requests finished per replica, keyed by its first device.
    plan : tfnb.Plan or None
        The replicated plan this placement applied.
    healing : bool
        Whether a lost copy is placed again once its workers answer (``heal``; on by default).
    moved : int
        Times a request went on on another copy after its own failed.
    """

    def __init__(self, replicas: list[PlacedModel], plan=None, *, heal: bool = True):
        if not replicas:
            raise ValueError("a replicated model needs at least one replica")
        self.replicas, self.plan = list(replicas), plan
        self.config, self.tokenizer, self.name = (replicas[0].config, replicas[0].tokenizer,
                                                  replicas[0].name)
        self._lock = threading.Lock()
        self._in_flight = {id(r): 0 for r in replicas}
        self.served = {r.devices[0]: 0 for r in replicas}
        self.last_stats: dict | None = None
        self.moved = 0  # times a request went on on another copy after its copy failed
        self._copies = [_Copy(r) for r in replicas]
        self._warm_asked: tuple | None = None  # (modes, prompt_tokens) of warmup(), for healing
        from tfnb.cluster.connect import current

        # the cluster the copies were placed on: healing reconnects and places there only, and
        # stops for good once another cluster is connected (the copies' loss is then final)
        cluster = current(required=False)
        devices = {d for r in replicas for d in r.devices}
        self._cluster = cluster if cluster is not None and devices <= set(cluster.devices) \
            else None
        self._wake = threading.Condition()
        self._heal_lock = threading.Lock()
        self._healing, self._closed, self._healer = False, False, None
        weakref.finalize(self, _notify, self._wake)  # a healer waiting ends when this is gone
        self.heal(heal)

    @property
    def devices(self) -> list[str]:
        """The devices of the replicas still serving, replica by replica."""
        return [d for r in self.replicas for d in r.devices]

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests running or queued per replica (keyed by its first device) now."""
        with self._lock:
            return {r.devices[0]: self._in_flight[id(r)] for r in self.replicas}

    @property
    def assignment(self) -> dict[str, str]:
        """The first replica's assignment (every stage on its device)."""
        return self._copies[0].replica.assignment

    @property
    def variables(self) -> list:
        return [v for r in self.replicas for v in r.variables]

    @property
    def eos_ids(self) -> tuple:
        return self._copies[0].replica.eos_ids

    @eos_ids.setter
    def eos_ids(self, value) -> None:
        for c in self._copies:
            c.replica.eos_ids = value

    # ----- routing ----------------------------------------------------------------------------

    def _pick(self) -> PlacedModel:
        with self._lock:
            alive = [r for r in self.replicas if r.lost is None]
            for r in list(self.replicas):
                if r.lost is not None:
                    self._drop(r, r.lost)
            if not alive:
                then = ("it is placed again in the background once its workers answer; try "
                        "again later" if self._healing else
                        "reconnect the cluster and place the model again")
                raise WorkerLostError(f"every replica of {self.name or 'this model'} lost its "
                                      f"worker; {then}")
            replica = min(alive, key=lambda r: self._in_flight[id(r)])
            self._in_flight[id(replica)] += 1
            return replica

    def _drop(self, replica: PlacedModel, why, stacklevel: int = 4) -> None:
        """Take a lost replica out of rotation (under ``_lock``); the healer is told."""
        copy = next((c for c in self._copies if c.replica is replica), None)
        if copy is None or copy.state != "serving":
            return  # dropped already, or a copy replaced since
        copy.state, copy.lost_at = "lost", time.time()
        self.replicas = [c.replica for c in self._copies if c.state == "serving"]
        then = "it rejoins once its workers answer again" if self._healing else \
            "it stays out (healing is off)"
        warnings.warn(f"replica on {' + '.join(replica.devices)} dropped: {why}; "
                      f"{len(self.replicas)} replica(s) keep serving; {then}",
                      ReplicaLostWarning, stacklevel=stacklevel)
        _notify(self._wake)

    def _done(self, replica: PlacedModel, error: BaseException | None,
              served: bool = True) -> None:
        with self._lock:
            self._in_flight[id(replica)] = self._in_flight.get(id(replica), 0) - 1
            if not served:
                return
            if error is None:
                self.served[replica.devices[0]] = self.served.get(replica.devices[0], 0) + 1
                self.last_stats = replica.last_stats
            elif isinstance(error, WorkerLostError) and replica.lost is not None:
                self._drop(replica, str(error).split(";")[0])

    def _route(self, method: str, prompts, options: dict):
        """Run a generate call on the least loaded copy; when that copy fails, its unfinished
        rows continue on another (``GenerateSession.failover``), streams included."""
        tries = _Tries(len(self.replicas))
        replica = self._pick()
        try:
            session = replica._session(prompts, options, text=method != "generate_ids")
        except BaseException as e:
            self._done(replica, e, served=False)  # a bad argument, or a copy lost just now
            raise
        session.failover = lambda old, error: self._next_copy(old, error, tries)
        if session.request.stream:
            self._done(replica, None, served=False)  # a stream counts while it is read
            return self._streamed(session)
        try:
            session.run_ids()
        except BaseException as e:
            self._done(session.pm, e)
            raise
        self._done(session.pm, None)
        if method == "generate_ids":
            return session.ids[0] if session.single else session.ids
        texts = session._texts()
        return texts[0] if session.single else texts

    def _next_copy(self, old: PlacedModel, error: WorkerLostError, tries: _Tries):
        """The copy a failed request continues on, or ``error`` raised when none is left.

        One try per copy, counted from the start: a request whose copy was dropped keeps its
        tries for the others. Right after a worker dies, a surviving copy's call can fail too,
        though its workers answer (TF errors from the dying calls reach calls on other workers:
        "recvmsg:Connection reset by peer", "failed to connect to all addresses" naming the dead
        worker's port, InvalidArgumentError "Unable to find the relevant tensor remote_handle";
        faults.call_with_deadline). Such a failure leaves the copy serving (unconfirmed), and
        the request gets up to SPARE_TRIES more, each after a pause that lets the failure
        settle. Four workers, task:3 killed under four requests (tests/test_hybrid.py): up to 2
        such failures in a row; with one spare try, 1 round in 8 failed a request; with these,
        none in 10."""
        self._done(old, error)
        serving = old.lost is None  # its workers answer: a passing failure
        if serving:
            tries.spare -= 1
        else:
            tries.left -= 1
        if tries.left <= 0 or tries.spare < 0 or not any(r.lost is None for r in self.replicas):
            raise error
        if serving:
            time.sleep(SETTLE_S * 2 ** (SPARE_TRIES - 1 - tries.spare))
        copy = self._pick()
        with self._lock:
            self.moved += 1
        return copy

    def _streamed(self, session):
        """The stream of ``session``, counted in flight on the copy it runs on while read."""
        with self._lock:
            self._in_flight[id(session.pm)] = self._in_flight.get(id(session.pm), 0) + 1
        error = None
        try:
            yield from (session.iter_text() if session.text else session.iter_ids())
        except BaseException as e:
            error = e
            raise
        finally:
            self._done(session.pm, error)

    # ----- status ----------------------------------------------------------------------------

    def serving_status(self) -> dict:
        """What every replica is serving now, as plain data (cheap, read-only): the shape of
        ``PlacedModel.serving_status``, one entry of ``replicas`` per copy in plan order (lost
        ones included), each with ``routed`` (requests this router sent there that have not
        returned, queued ones included), ``finished`` (its count in ``served``), ``state``
        (``serving``, ``lost`` or ``restoring``), ``lost_at`` and ``restored_at`` (the last
        times it was dropped and put back, ``time.time()``, or None) and ``heal_error`` (why
        the last try to restore it failed, or None); ``moved`` counts the times a request went
        on on another copy after its own failed.

        Examples
        --------
        >>> st = placed.serving_status()                                 # doctest: +SKIP
        >>> [(r["devices"][0][-5:], r["state"], r["lanes"][0]["rows_in_use"])  # doctest: +SKIP
        ...  for r in st["replicas"]]
        [('CPU:0', 'serving', 2), ('CPU:0', 'restoring', 0)]
        """
        with self._lock:
            copies = [(c.replica, c.state, c.lost_at, c.restored_at, c.heal_error)
                      for c in self._copies]
            routed = {id(r): self._in_flight.get(id(r), 0) for r, *_ in copies}
            finished = dict(self.served)
        parts = []
        for i, (r, state, lost_at, restored_at, heal_error) in enumerate(copies):
            part = r.replica_status(i)
            part.update(routed=routed[id(r)], finished=finished.get(r.devices[0], 0),
                        state=state, lost_at=lost_at, restored_at=restored_at,
                        heal_error=heal_error)
            parts.append(part)
        status = serving_summary(self.name, parts)
        status["healing"], status["moved"] = self._healing, self.moved
        return status

    # ----- healing ---------------------------------------------------------------------------

    @property
    def healing(self) -> bool:
        """Whether lost copies are placed again when their workers answer (see ``heal``)."""
        return self._healing

    def heal(self, enabled: bool = True) -> None:
        """Turn healing on (the default) or off.

        With healing, a background thread looks at the copies every ``HEAL_EVERY_S`` and
        probes their workers (about 1 ms each on loopback). When a lost copy's workers answer
        again (a worker restarted on the same address), it reconnects the cluster, places that
        copy anew from the client on the same devices, warms it as ``warmup`` warmed the copies
        (waiting up to ``HEAL_WARM_S``), and puts it back in rotation with a
        :class:`ReplicaRestoredWarning`. Surviving copies keep serving throughout. A failed try
        is made again after a pause (doubling, up to ``HEAL_BACKOFF_S``). Healing needs the
        cluster the copies were placed on, and stops for good once another is connected.

        Examples
        --------
        >>> placed.heal(False)          # a lost copy stays lost          # doctest: +SKIP
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled={enabled!r}: expected True or False")
        with self._heal_lock:
            self._healing = enabled and not self._closed
            if self._healing and self._healer is None and self._cluster is not None:
                self._healer = start_thread(_heal_loop, weakref.ref(self), self._wake,
                                            name="tfnb-heal", wake=self._wake)
        _notify(self._wake)

    def close(self) -> None:
        """Stop healing and drop the shapes still queued to compile; the copies keep their
        state on the workers until this model is garbage-collected.

        A heal under way is waited for (up to ``HEAL_CALL_S``): nothing reconnects or places
        after ``close`` returns, so the workers may be stopped then (a reconnect to workers
        stopping under it can hang in TensorFlow, holding the cluster lock for good)."""
        self._closed = True
        with self._heal_lock:
            healer = self._healer
        self.heal(False)
        self.cancel_warmup()
        if healer is not None and healer is not threading.current_thread():
            healer.join(HEAL_CALL_S)

    def _heal_turn(self) -> bool:
        """One look at the copies (the healer's loop body); False ends healing for good."""
        from tfnb.cluster.connect import current
        from tfnb.cluster.probe import probe_all

        cluster = self._cluster
        if self._closed or not cluster.connected or current(required=False) is not cluster:
            return False
        with self._lock:
            for c in self._copies:
                if c.state == "serving" and c.replica.lost is not None:
                    self._drop(c.replica, c.replica.lost, stacklevel=2)
        tasks = {d.split("/device:")[0] for c in self._copies for d in c.replica.devices}
        addresses = {t: a for a, t in zip(cluster.spec.addresses, cluster.workers) if t in tasks}
        probes = probe_all(list(addresses.values()), PROBE_TIMEOUT_S)
        up = {p.address for p in probes if p.state == "up"}
        known = cluster.incarnations
        restarted = [p.address for p in probes
                     if p.state == "up" and p.incarnation != known.get(p.address)]
        now = time.monotonic()
        ready = [c for c in self._copies if c.state == "lost" and now >= c.next_try and all(
            addresses[d.split("/device:")[0]] in up for d in c.replica.devices)]
        if not ready and not restarted:
            return True
        # A reconnect (TF's connect_to_cluster again, same spec and client address) leaves the
        # surviving copies alone. Probed (TF 2.21, two local workers, task 1 killed and
        # restarted): a variable on task 0 kept its value, six generate calls on the task 0
        # copy running across the reconnect all gave the same tokens as before, and the GIL was
        # never held over 15 ms. Only state on the restarted worker is gone. So the copies that
        # serve go on serving; only the lost ones are placed again.
        try:
            # only while this cluster is still the process's: a cluster connected since the
            # turn began (another test, another %tfcluster) must not be undone by this reconnect
            call_with_deadline(lambda: cluster.reconnect(only_if_current=True), (),
                               timeout=HEAL_CALL_S, devices=cluster.devices,
                               what="reconnecting to heal")
        except NotConnectedError:
            return False  # another cluster is connected: these copies' loss is final
        except Exception as e:  # noqa: BLE001 - e.g. another worker still down: next turn
            for c in ready:
                self._failed(c, f"reconnecting failed: {type(e).__name__}: {e}")
            return True
        with self._lock:  # the reconnect marked the copies on restarted workers lost
            for c in self._copies:
                if c.state == "serving" and c.replica.lost is not None:
                    self._drop(c.replica, c.replica.lost, stacklevel=2)
            ready = [c for c in self._copies if c.state == "lost" and now >= c.next_try]
        for c in ready:
            if not self._restore(c, cluster):
                return not self._closed
        return True

    def _restore(self, copy: _Copy, cluster) -> bool:
        """Place ``copy`` anew, warm it and put it in rotation; False when healing was stopped
        meanwhile (the new placement is then dropped)."""
        from tfnb.cluster.connect import current

        old = copy.replica
        with self._lock:
            copy.state = "restoring"
        new = None
        try:
            # from the client, as tfnb.place did: the same weights and assignment; a lost
            # placement reuses none of its variables
            new = old.replace(old.assignment)
            new.plan, new.max_batch, new.eos_ids = old.plan, old.max_batch, old.eos_ids
            cluster.register(new, f"{self.name} replica on "
                             f"{' + '.join(short_device(d) for d in new.devices)}", new.devices)
            asked = self._warm_asked
            if asked is not None:
                warm_up([new], asked[0], asked[1], wait=False, timeout=None)
                deadline = time.monotonic() + HEAL_WARM_S
                while not new.scheduler.wait_warm(1.0) and time.monotonic() < deadline:
                    if self._stopping(cluster):
                        break
            if self._stopping(cluster) or new.lost is not None:
                raise WorkerLostError(new.lost or "healing was stopped")
        except Exception as e:  # noqa: BLE001 - the copy stays lost; tried again later
            if new is not None:
                new.cancel_warmup()
            if self._stopping(cluster):
                with self._lock:
                    copy.state = "lost"
                return False
            self._failed(copy, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            return True
        with self._lock:
            copy.replica, copy.state, copy.restored_at = new, "serving", time.time()
            copy.heal_error, copy.tries, copy.next_try = None, 0, 0.0
            self._in_flight[id(new)] = 0
            self.replicas = [c.replica for c in self._copies if c.state == "serving"]
            n = len(self.replicas)
        warnings.warn(f"replica on {' + '.join(new.devices)} restored: placed again on its "
                      f"restarted worker(s) and back in rotation; {n} replica(s) serve",
                      ReplicaRestoredWarning, stacklevel=2)
        return current(required=False) is cluster

    def _stopping(self, cluster) -> bool:
        from tfnb.cluster.connect import current

        return (self._closed or not self._healing or exiting() or not cluster.connected
                or current(required=False) is not cluster)

    def _failed(self, copy: _Copy, why: str) -> None:
        with self._lock:
            copy.state, copy.heal_error = "lost", why
            copy.tries += 1
            copy.next_try = time.monotonic() + min(HEAL_BACKOFF_S, 2.0 ** copy.tries)

    # ----- the PlacedModel API ------------------------------------------------------------------

    def warmup(self, modes=("greedy",), prompt_tokens: int | None = None, *, wait: bool = True,
               timeout: float | None = None) -> dict:
        """``PlacedModel.warmup`` on every replica still serving, at once (their workers
        compile side by side)."""
        with self._lock:
            replicas = [c.replica for c in self._copies]  # warm_up skips lost ones
        asked = self._warm_asked
        modes = [modes] if isinstance(modes, str) else modes
        try:
            # a copy restored later is warmed the same way (the union of what was asked)
            self._warm_asked = (tuple(dict.fromkeys([*(asked[0] if asked else ()), *modes])),
                                prompt_tokens if asked is None or prompt_tokens is None
                                or asked[1] is None else max(prompt_tokens, asked[1]))
        except TypeError:
            pass  # bad modes: warm_up says what is accepted
        try:
            return warm_up(replicas, modes, prompt_tokens, wait, timeout)
        except BaseException:
            self._warm_asked = asked
            raise

    def cancel_warmup(self) -> None:
        """``PlacedModel.cancel_warmup`` on every replica; a copy restored later is not warmed."""
        self._warm_asked = None
        with self._lock:
            replicas = [c.replica for c in self._copies]
        for r in replicas:
            r.cancel_warmup()

    @with_options_signature
    def generate(self, prompts, **options):
        """``PlacedModel.generate`` on the least loaded replica."""
        return self._route("generate", prompts, options)

    @with_options_signature
    def generate_ids(self, prompts, **options):
        """``PlacedModel.generate_ids`` on the least loaded replica."""
        return self._route("generate_ids", prompts, options)

    def chat(self, message_or_messages, **options):
        """``PlacedModel.chat`` on the least loaded replica."""
        return PlacedModel.chat(self, message_or_messages, **options)

    def logits(self, prompts):
        """``PlacedModel.logits`` on the least loaded replica (tried again on another when its
        copy fails)."""
        tries = _Tries(len(self.replicas))
        replica = self._pick()
        while True:
            try:
                result = replica.logits(prompts)
            except WorkerLostError as e:
                replica = self._next_copy(replica, e, tries)  # raises when none is left
                continue
            except BaseException as e:
                self._done(replica, e)
                raise
            self._done(replica, None)
            return result

    def route_summary(self) -> str:
        """Each device's matmul route over the copies (``PlacedModel.route_summary``)."""
        return ", ".join(dict.fromkeys(r.route_summary() for r in self.replicas))

    def __repr__(self) -> str:
        return (f"ReplicatedModel({self.name or 'llama'}: {len(self.replicas)} replicas on "
                f"{self.devices}; weights: {self.route_summary()})")


def _notify(wake: threading.Condition) -> None:
    with wake:
        wake.notify_all()


def _heal_loop(ref: weakref.ref, wake: threading.Condition) -> None:
    """The healer thread: a turn every ``HEAL_EVERY_S`` while its model lives and heals.

    It holds the model only during a turn, so the model can be garbage-collected between turns
    (its finalizer wakes this thread, which then ends). Waits are on ``wake``, GIL released."""
    while not exiting():
        model = ref()
        if model is None:
            return
        with model._heal_lock:
            if not model._healing:
                model._healer = None
                return
        try:
            go_on = model._heal_turn()
        except Exception as e:  # noqa: BLE001 - a turn that failed is tried again
            warnings.warn(f"healing {model.name or 'a replicated model'}: {type(e).__name__}: "
                          f"{e}", RuntimeWarning, stacklevel=1)
            go_on = True
        if not go_on:
            with model._heal_lock:
                model._healing, model._healer = False, None
            return
        del model
        with wake:
            wake.wait(HEAL_EVERY_S)

