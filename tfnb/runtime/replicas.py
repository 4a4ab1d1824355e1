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
:class:`ReplicaLostWarning` and the others keep serving. A request that was running on it is
retried on another replica when nothing of it reached the caller yet (it returns its result at
the end, and no chunk event had been handed to an ``on_chunk`` callback), with one try per
replica, and a few more, spaced out, for the moments after a loss when a surviving replica's
call fails too though its workers answer; otherwise, and for a stream, it fails with
``WorkerLostError``, since part of its output may have been shown. With no replica left, a
request fails with ``WorkerLostError``.

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

from tfnb.errors import WorkerLostError
from tfnb.runtime.placed import PlacedModel, serving_summary, warm_up
from tfnb.runtime.requests import with_options_signature

__all__ = ["ReplicatedModel", "ReplicaLostWarning"]

SPARE_TRIES = 4   # a request's retries after failures that left their replica serving
SETTLE_S = 0.25   # the pause before the first of them; doubled before each next one


class ReplicaLostWarning(UserWarning):
    """A replica of a replicated model lost its worker and no longer takes requests."""


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
    """

    def __init__(self, replicas: list[PlacedModel], plan=None):
        if not replicas:
            raise ValueError("a replicated model needs at least one replica")
        self.replicas, self.plan = list(replicas), plan
        self.config, self.tokenizer, self.name = (replicas[0].config, replicas[0].tokenizer,
                                                  replicas[0].name)
        self._lock = threading.Lock()
        self._in_flight = {id(r): 0 for r in replicas}
        self.served = {r.devices[0]: 0 for r in replicas}
        self.last_stats: dict | None = None

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
        return self.replicas[0].assignment

    @property
    def variables(self) -> list:
        return [v for r in self.replicas for v in r.variables]

    @property
    def eos_ids(self) -> tuple:
        return self.replicas[0].eos_ids

    @eos_ids.setter
    def eos_ids(self, value) -> None:
        for r in self.replicas:
            r.eos_ids = value

    # ----- routing ----------------------------------------------------------------------------

    def _pick(self) -> PlacedModel:
        with self._lock:
            alive = [r for r in self.replicas if r.lost is None]
            for r in list(self.replicas):
                if r.lost is not None:
                    self._drop(r, r.lost)
            if not alive:
                raise WorkerLostError(f"every replica of {self.name or 'this model'} lost its "
                                      "worker; reconnect the cluster and place the model again")
            replica = min(alive, key=lambda r: self._in_flight[id(r)])
            self._in_flight[id(replica)] += 1
            return replica

    def _drop(self, replica: PlacedModel, why) -> None:
        if replica in self.replicas and len(self.replicas) > 1:
            self.replicas.remove(replica)
            warnings.warn(f"replica on {' + '.join(replica.devices)} dropped: {why}; "
                          f"{len(self.replicas)} replica(s) keep serving", ReplicaLostWarning,
                          stacklevel=4)

    def _done(self, replica: PlacedModel, error: BaseException | None,
              served: bool = True) -> None:
        with self._lock:
            self._in_flight[id(replica)] -= 1
            if not served:
                return
            if error is None:
                self.served[replica.devices[0]] += 1
                self.last_stats = replica.last_stats
            elif isinstance(error, WorkerLostError) and replica.lost is not None:
                self._drop(replica, str(error).split(";")[0])

    def _route(self, method: str, prompts, options: dict):
        if options.get("stream"):
            replica = self._pick()
            return self._stream(replica, method, prompts, options)
        # One try per replica, counted from the start: a request whose replica was dropped
        # keeps its tries for the others. Right after a worker dies, a surviving replica's call
        # can fail too, though its workers answer (TF errors from the dying calls reach calls on
        # other workers: "recvmsg:Connection reset by peer", "failed to connect to all
        # addresses" naming the dead worker's port, InvalidArgumentError "Unable to find the
        # relevant tensor remote_handle"; faults.call_with_deadline). Such a failure leaves the
        # replica serving (unconfirmed), and the request gets up to SPARE_TRIES more, each after
        # a pause that lets the failure settle. Four workers, task:3 killed under four requests
        # (tests/test_hybrid.py): up to 2 such failures in a row; with one spare try, 1 round
        # in 8 failed a request; with these, none in 10.
        tries, spare = len(self.replicas), SPARE_TRIES
        while True:
            replica = self._pick()
            try:
                result = getattr(replica, method)(prompts, **options)
            except WorkerLostError as e:
                self._done(replica, e)
                serving = replica.lost is None  # its workers answer: a passing failure
                if serving:
                    spare -= 1
                else:
                    tries -= 1
                if e.reached_caller or tries <= 0 or spare < 0 or \
                        not any(r.lost is None for r in self.replicas):
                    raise
                if serving:
                    time.sleep(SETTLE_S * 2 ** (SPARE_TRIES - 1 - spare))
                continue
            except BaseException as e:
                self._done(replica, e)
                raise
            self._done(replica, None)
            return result

    def _stream(self, replica, method, prompts, options):
        try:
            chunks = getattr(replica, method)(prompts, **options)  # checks the arguments now
        finally:
            self._done(replica, None, served=False)  # a stream counts while it is read
        return self._streamed(replica, chunks)

    def _streamed(self, replica, chunks):
        with self._lock:
            self._in_flight[id(replica)] += 1
        error = None
        try:
            yield from chunks
        except BaseException as e:
            error = e
            raise
        finally:
            self._done(replica, error)

    # ----- status ----------------------------------------------------------------------------

    def serving_status(self) -> dict:
        """What every replica is serving now, as plain data (cheap, read-only): the shape of
        ``PlacedModel.serving_status``, one entry of ``replicas`` per replica still serving,
        each with ``routed`` (requests this router sent there that have not returned, queued
        ones included) and ``finished`` (its count in ``served``).

        Examples
        --------
        >>> st = placed.serving_status()                                 # doctest: +SKIP
        >>> [(r["devices"][0][-5:], r["lanes"][0]["rows_in_use"])        # doctest: +SKIP
        ...  for r in st["replicas"]]
        [('CPU:0', 2), ('CPU:0', 1)]
        """
        with self._lock:
            replicas = list(self.replicas)
            routed = {id(r): self._in_flight[id(r)] for r in replicas}
            finished = dict(self.served)
        parts = []
        for i, r in enumerate(replicas):
            part = r.replica_status(i)
            part.update(routed=routed[id(r)], finished=finished.get(r.devices[0], 0))
            parts.append(part)
        return serving_summary(self.name, parts)

    # ----- the PlacedModel API ------------------------------------------------------------------

    def warmup(self, modes=("greedy",), prompt_tokens: int | None = None, *, wait: bool = True,
               timeout: float | None = None) -> dict:
        """``PlacedModel.warmup`` on every replica still serving, at once (their workers
        compile side by side)."""
        with self._lock:
            replicas = list(self.replicas)
        return warm_up(replicas, modes, prompt_tokens, wait, timeout)

    def cancel_warmup(self) -> None:
        """``PlacedModel.cancel_warmup`` on every replica."""
        for r in list(self.replicas):
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
        return self._route("chat", message_or_messages, options)

    def logits(self, prompts):
        """``PlacedModel.logits`` on the least loaded replica."""
        return self._route("logits", prompts, {})

    def __repr__(self) -> str:
        return (f"ReplicatedModel({self.name or 'llama'}: {len(self.replicas)} replicas on "
                f"{self.devices})")

