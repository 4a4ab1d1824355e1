"""``measure_topology(cluster)``: speeds, links and memory of a connected cluster, measured.

- **compute**: on each device (``tf.device``), a ``tf.function`` chaining ``matmuls`` products of
  ``n x n`` float32 matrices; FLOP/s = ``2 n^3 matmuls / (best time - best time of an empty
  call)``, the empty call removing the client's round trip.
- **links**: for every pair ``(a, b)``, a ``tf.function`` that sends a tensor from ``a`` to
  ``b`` and back (a ping-pong) and returns one number to the client; the same function without
  the hops is the baseline. One-way latency = half the extra time with a 1-element tensor;
  bandwidth = bytes / (half the extra time with a ``tensor_bytes`` tensor - latency). Links are
  taken as symmetric. Every figure is the best of ``repeats`` runs (the machines are noisy).
- **kinds**: with ``smooth=True`` (default) the devices of one type on one host are taken as
  identical: their FLOP/s averaged, memory the smallest, links averaged per pair of kinds. CPU
  devices are alike only when their workers may use as many CPUs (``tfnb worker --cpus``); a
  CPU device whose worker does not say is a kind of its own.
- **memory**: from ``cluster.status()``: an accelerator's free memory (or TF's limit); for CPU
  devices the host's available RAM, divided among the workers that share that host.
- **memory bandwidth** (``memory_bandwidth``): on each device, a ``tf.function`` summing a
  ``nbytes`` float32 tensor that lives there (made there, not sent), against the same call
  summing one element; bytes / the extra time. What a decode step's memory-bound time is
  measured against (a profile's ``bound``).
- **stage times** (``calibrate``): seconds per decode step of each stage of a llama model on
  every device (:mod:`tfnb.runtime.calibrate`). Twins by description (one kind, above) whose
  times for the whole model are alike (within ``ALIKE``, or 1 ms) share the mean of their
  figures, so they stay interchangeable; a twin slower than that (its machine busy with other
  work) keeps its own times and becomes a class of its own: the short matrix products above
  do not see a busy core, a decode step does (docs/placement.md).

The whole measurement stops starting new work after ``budget_s`` seconds; pairs not measured by
then get the slowest measured link (a warning says how many). Results are cached per cluster
(sorted device names + worker incarnations + settings); ``refresh=True`` measures again.
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np

from tfnb.models.chain import block_stage
from tfnb.placement.cost import Topology

__all__ = ["measure_topology", "memory_bandwidth", "calibrate", "calibration_timer", "clear_cache"]

_CACHE: dict = {}
ALIKE = 1.3  # whole-model times within this ratio (or 1 ms): the same kind, figures averaged


def clear_cache() -> None:
    """Forget every cached measurement."""
    _CACHE.clear()


def _best(fn, arg, repeats: int) -> float:
    fn(arg).numpy()  # trace + warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(arg).numpy()
        times.append(time.perf_counter() - t)
    return min(times)


def _on(tf, device: str, value):
    """``value`` (made on this client) copied to ``device`` by an op: a Python value converted
    under a remote device scope would hold the GIL until the worker answers (see
    ``tfnb.runtime.graphs.OnDevice``)."""
    with tf.device(device):
        return tf.identity(value)


def _compute_flops(tf, device: str, n: int, matmuls: int, repeats: int) -> float:
    a = _on(tf, device, tf.random.uniform((n, n), 0.0, 1.0 / n))

    @tf.function
    def chain(x):
        with tf.device(device):
            y = x
            for _ in range(matmuls):
                y = tf.matmul(y, x)
            return y[0, 0]

    @tf.function
    def empty(x):
        with tf.device(device):
            return x[0, 0] * 2.0

    base, full = _best(empty, a, repeats), _best(chain, a, repeats)
    work = 2.0 * n ** 3 * matmuls
    return work / (full - base) if full > 1.5 * base else work / full


def _pair(tf, a: str, b: str, tensors, repeats: int) -> tuple[float, float]:
    """(one-way latency s, bandwidth B/s) between devices ``a`` and ``b``, by ping-pong."""

    def make(hop: bool):
        @tf.function
        def f(x):
            y = x
            if hop:
                with tf.device(b):
                    y = y * 2.0
            with tf.device(a):
                y = y * 0.5
                return y[0] + y[-1]
        return f

    there, here = make(True), make(False)
    extra = []
    for x in tensors:
        extra.append(max(0.0, (_best(there, x, repeats) - _best(here, x, repeats)) / 2))
    latency = max(extra[0], 1e-7)
    nbytes = float(tensors[1].shape[0] * 4)
    transfer = extra[1] - latency
    return latency, nbytes / (transfer if transfer > 0.05 * extra[1] else max(extra[1], 1e-7))


def _memory_and_kinds(cluster, devices: list[str]) -> tuple[list[float], list[tuple]]:
    """Memory cap and kind (host, type, CPUs) of each device, from one ``cluster.status()``."""
    status = cluster.status()
    cpus: dict[str, int] = {}
    found = {}
    for w in status.workers:
        host = w.address.rsplit(":", 1)[0]
        for d in w.devices:
            cpus[host] = cpus.get(host, 0) + (d.device_type == "CPU")
            found[d.name] = (host, d, w)
    memory, kinds = [], []
    for dev in devices:
        host, d, w = found.get(dev, (dev, None, None))
        value = None if d is None else (d.memory_free or d.memory_total)
        if d is not None and d.device_type == "CPU" and value:
            value = value / cpus[host]
        memory.append(float(value) if value else math.inf)
        kind = dev.rsplit("device:", 1)[-1].split(":")[0]
        if kind == "CPU":
            kinds.append((host, kind, w.cpus if w is not None and w.cpus else dev))
        else:
            kinds.append((host, kind))
    return memory, kinds


def _smooth(kind, memory, flops, latency, bandwidth):
    """Average the figures of each kind of device (see ``_memory_and_kinds``).

    Measurements are noisy: without this every device would differ a little from its twins,
    and the exact planner, which groups interchangeable devices, would face them one by one.
    """
    groups: dict = {}
    for i, k in enumerate(kind):
        groups.setdefault(k, []).append(i)
    memory, flops = np.array(memory), np.array(flops)
    lat, bw = latency.copy(), bandwidth.copy()
    for members in groups.values():
        memory[members] = memory[members].min()
        flops[members] = flops[members].mean()
    for a in groups.values():
        for b in groups.values():
            block = np.ix_(a, b)
            off = ~np.eye(len(a), dtype=bool) if a is b else np.ones((len(a), len(b)), bool)
            if off.any():
                lat[block] = np.where(off, latency[block][off].mean(), lat[block])
                bw[block] = np.where(off, bandwidth[block][off].mean(), bw[block])
    return memory, flops, lat, bw


def measure_topology(cluster, devices=None, *, repeats: int = 5, tensor_bytes: int = 4_000_000,
                     matmul_n: int = 256, matmuls: int = 4, budget_s: float = 60.0,
                     smooth: bool = True, refresh: bool = False) -> Topology:
    """Measure a connected cluster's devices and links into a :class:`Topology` (cached).

    Parameters
    ----------
    cluster : a connected :class:`tfnb.cluster.Cluster`
    devices : the devices to measure (default: ``cluster.devices``)
    repeats : timed runs per figure (the best is kept)
    tensor_bytes : size of the tensor that measures bandwidth
    matmul_n, matmuls : size and count of the matrix products that measure FLOP/s
    budget_s : no new pair is started after this many seconds
    smooth : average the figures of devices of one type on one host, making them
        interchangeable (the exact planner then treats them as one kind)
    refresh : measure again even if a cached result exists

    Examples
    --------
    >>> topo = measure_topology(tfnb.current())                      # doctest: +SKIP
    >>> topo.latency[0, 1] * 1e3, topo.bandwidth[0, 1] / 1e9          # doctest: +SKIP
    (0.4, 1.1)
    """
    devices = list(cluster.devices if devices is None else devices)
    key = (_cluster_key(cluster, devices), repeats, tensor_bytes, matmul_n, matmuls, smooth)
    if not refresh and key in _CACHE:
        return _CACHE[key]
    # the runtime imports TensorFlow: here, so that planning on a Topology never does
    from tfnb.runtime.faults import call_with_deadline

    # bounded like every call on the cluster: a silent worker fails the measurement in seconds
    topo = call_with_deadline(_measure, (cluster, devices, repeats, tensor_bytes, matmul_n,
                                         matmuls, budget_s, smooth),
                              timeout=2 * budget_s + 120, devices=devices,
                              what="measuring the cluster")
    _CACHE[key] = topo
    return topo


def _measure(cluster, devices, repeats, tensor_bytes, matmul_n, matmuls, budget_s, smooth):
    import tensorflow as tf

    start = time.perf_counter()
    flops = [_compute_flops(tf, d, matmul_n, matmuls, repeats) for d in devices]
    n = len(devices)
    latency, bandwidth = np.full((n, n), np.nan), np.full((n, n), np.nan)
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, np.inf)
    skipped = 0
    for a in range(n):
        for b in range(a + 1, n):
            if time.perf_counter() - start > budget_s:
                skipped += 1
                continue
            tensors = [_on(tf, devices[a], tf.ones((1,))),
                       _on(tf, devices[a], tf.ones((max(1, tensor_bytes // 4),)))]
            lat, bw = _pair(tf, devices[a], devices[b], tensors, repeats)
            latency[a, b] = latency[b, a] = lat
            bandwidth[a, b] = bandwidth[b, a] = bw
    if skipped:
        warnings.warn(f"measure_topology: {skipped} device pairs not measured within budget_s="
                      f"{budget_s}; they get the slowest measured link", stacklevel=2)
        off = ~np.eye(n, dtype=bool)
        lat_fill = np.nanmax(latency[off]) if np.isfinite(latency[off]).any() else 1e-3
        bw_fill = np.nanmin(bandwidth[off]) if np.isfinite(bandwidth[off]).any() else 1e8
        latency[np.isnan(latency)], bandwidth[np.isnan(bandwidth)] = lat_fill, bw_fill
    memory, kinds = _memory_and_kinds(cluster, devices)
    if smooth:
        memory, flops, latency, bandwidth = _smooth(kinds, memory, flops, latency, bandwidth)
    return Topology(devices, memory=memory, flops=flops, latency=latency, bandwidth=bandwidth)


def memory_bandwidth(cluster, devices=None, *, nbytes: int = 256_000_000, repeats: int = 5,
                     refresh: bool = False, timeout: float = 120.0) -> dict[str, float]:
    """``{device: bytes/s}`` each device reads from its memory (cached per cluster; see the
    module docstring). Bounded: a silent worker fails it within the liveness bound.

    Examples
    --------
    >>> bw = memory_bandwidth(tfnb.current())                        # doctest: +SKIP
    >>> {d[-20:]: round(b / 1e9, 1) for d, b in bw.items()}          # doctest: +SKIP
    {'/task:0/device:CPU:0': 14.2, '/task:1/device:CPU:0': 13.8}
    """
    devices = list(cluster.devices if devices is None else devices)
    key = ("bandwidth", _cluster_key(cluster, devices), nbytes, repeats)
    if refresh or key not in _CACHE:
        from tfnb.runtime.faults import call_with_deadline

        _CACHE[key] = call_with_deadline(lambda: {d: _read_bandwidth(d, nbytes, repeats)
                                                  for d in devices}, (), timeout=timeout,
                                         devices=devices, what="measuring memory bandwidth")
    return _CACHE[key]


def _read_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    import tensorflow as tf

    n = max(1, nbytes // 4)

    @tf.function
    def make(n):
        with tf.device(device):
            return tf.fill(tf.reshape(n, [1]), 1.0)

    big, small = make(tf.constant(n)), make(tf.constant(1))

    @tf.function
    def total(x):
        with tf.device(device):
            return tf.reduce_sum(x)

    t_big, t_small = _best(total, big, repeats), _best(total, small, repeats)
    return nbytes / max(t_big - t_small, 1e-9)


def _cluster_key(cluster, devices) -> tuple:
    """Devices and worker incarnations: a restarted worker is measured again."""
    incarnations = getattr(cluster, "incarnations", None) or {}
    return tuple(sorted(devices)), tuple(sorted(incarnations.items()))


def calibrate(model, cluster, topology: Topology | None = None, *, batch: int = 1,
              context_len: int = 1024, prompt_len: int = 0, attend: int | None = None,
              refresh: bool = False, route=None) -> dict:
    """``{(stage, device): seconds per decode step}`` for every stage of ``model`` on every
    device of ``cluster``, timed on each device; devices of one class whose times are alike
    (within ``ALIKE``) share the mean of their figures (cached per cluster, model, batch, cache
    size and prompt). Each decode step attends ``attend`` slots (default: the whole
    ``context_len``). With ``prompt_len``: seconds per prefill of ``batch`` prompts of that many
    tokens instead (a few calls each: a prefill is about as long as a decode loop), padded as
    the runtime pads them. A packed model's stages run on the matmul ``route`` that placing
    with it gives each device (``tfnb.place``'s ``route``; None: auto).

    Examples
    --------
    >>> times = calibrate(model, tfnb.current())                     # doctest: +SKIP
    >>> round(times[("block.0", cluster.devices[0])] * 1e3, 2)        # doctest: +SKIP
    1.62
    """
    topology = topology or measure_topology(cluster)
    load = _timed_load(model, batch, context_len, prompt_len, attend)
    key = ("stages", _cluster_key(cluster, topology.devices), getattr(model, "name", None),
           repr(model.config), _kinds(model), batch, *load,
           repr(route) if set(_kinds(model)) - {-1} else None)  # a float model has no route
    if refresh or key not in _CACHE:
        _CACHE[key] = calibration_timer(model, cluster, topology, batch=batch,
                                        context_len=context_len, prompt_len=prompt_len,
                                        attend=attend, route=route)()
    return _CACHE[key]


def calibration_timer(model, cluster, topology: Topology | None = None, *, batch: int = 1,
                      context_len: int = 1024, prompt_len: int = 0, attend: int | None = None,
                      route=None):
    """``timer(repeats=None)``: what :func:`calibrate` returns, timed anew at every call (not
    cached), its loops built and compiled on the devices once. A benchmark times the stages
    between its own rounds with it, so its prediction and its measurement see the machine in
    the same state; ``repeats`` timed calls per loop (default: calibrate's)."""
    # tfnb.runtime imports TensorFlow: only when stages are timed.
    from tfnb.runtime.calibrate import stage_timer

    topology = topology or measure_topology(cluster)
    slots, padded, pad, attend = _timed_load(model, batch, context_len, prompt_len, attend)
    timer = stage_timer(model.config, topology.devices, batch=batch, slots=slots,
                        like=getattr(model, "weights", None), prompt=padded, pad=pad,
                        attend=attend, route=route)
    calls = {"steps": 3, "repeats": 5} if prompt_len else {}

    def timed(repeats: int | None = None) -> dict:
        return stage_table(timer(**{**calls, **({"repeats": repeats} if repeats else {})}),
                           topology, model.config.n_layers)

    return timed


def _timed_load(model, batch: int, context_len: int, prompt_len: int,
                attend: int | None) -> tuple[int, int, int, int | None]:
    """``(slots, padded prompt, its padding, attended slots)`` that calibration times for
    these arguments: the caches bucketed and the prompt padded as the runtime does."""
    from tfnb.runtime.requests import bucket

    config = model.config
    slots = bucket(max(1, context_len), 64, maximum=max(64, config.max_context))
    padded = pad = 0
    if prompt_len:  # padded as the runtime pads a prompt (tfnb.runtime.scheduler.Ticket)
        padded = bucket(prompt_len, 16)
        pad = padded - prompt_len
        slots = max(slots, bucket(padded, 64, maximum=max(64, config.max_context)))
    attend = None if prompt_len or attend is None else min(slots, attend)
    return slots, padded, pad, attend


def _kinds(model) -> tuple:
    """The ggml types of a model's weights (-1 for float tensors): what a stage's time depends
    on besides the shapes."""
    weights = getattr(model, "weights", None)
    return tuple(sorted({getattr(w, "qtype", -1) for w in (weights or {}).values()}))


def stage_table(timed: dict, topology: Topology, n_layers: int) -> dict:
    """``{(stage, device): seconds}`` from ``time_stages``' per-device figures: devices of one
    class whose times are alike (within ``ALIKE``) share the mean of their figures."""
    times = {}
    for members in topology.classes():
        devs = [topology.devices[d] for d in members]
        for group in _alike({dev: timed[dev] for dev in devs}, n_layers):
            # the mean: one calibration differs from the next by up to +-10% on a busy
            # machine (docs/placement.md); averaging narrows it
            per = {k: float(np.mean([timed[dev][k] for dev in group])) for k in timed[devs[0]]}
            for dev in group:
                times[("embed", dev)], times[("head", dev)] = per["embed"], per["head"]
                times.update({(block_stage(i), dev): per["block"] for i in range(n_layers)})
    return times


def _alike(timed: dict, n_layers: int) -> list[list]:
    """Devices grouped by the time of a whole model's decode step, fastest first; a group spans
    at most ``ALIKE`` or 1 ms (tiny models' times are mostly noise).

    >>> ms = lambda b: {"embed": 0.0, "block": b * 1e-3, "head": 6e-3}
    >>> _alike({"a": ms(1.0), "b": ms(1.78), "c": ms(1.1)}, 30)
    [['a', 'c'], ['b']]
    """
    total = {d: t["embed"] + n_layers * t["block"] + t["head"] for d, t in timed.items()}
    groups: list[list] = []
    for dev in sorted(timed, key=total.__getitem__):
        lead = total[groups[-1][0]] if groups else -math.inf  # the group's fastest
        if total[dev] <= max(lead * ALIKE, lead + 1e-3):
            groups[-1].append(dev)
        else:
            groups.append([dev])
    return groups
