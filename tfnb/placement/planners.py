"""``plan(model, cluster, mode=...)``: four ways to put a model's stages on devices.

- ``"replicate"``: a full copy on every device, the batch split across copies (what
  ``tf.distribute.MirroredStrategy`` does). When a copy does not fit one device, each copy is
  a pipeline over a group of consecutive devices, the fewest that hold it, cut as
  ``"optimal"`` cuts it for the plan's objective (a hybrid plan: 2 replicas x 2 stages on 4
  devices); at least two copies, devices left over stay idle.
- ``"memory"``: Hugging Face Accelerate's ``infer_auto_device_map`` fill, the baseline: devices
  in order (accelerators first), each stage on the current device if it still fits
  (``used + need <= cap``), otherwise on to the next device, never back. Stages are never split
  (every stage is a "no split" module). Unlike Accelerate, nothing is offloaded, so no room is
  reserved for bringing offloaded layers back, and a tied head is charged its own copy.
- ``"greedy"``: the TensorFlow whitepaper's simulated placement: stages in order, each to the
  device where it would *finish earliest* (arrival of its input over the link + its compute
  there), among devices with room left; ties go to the earlier device. It ignores the return hop.
- ``"optimal"``: exact over pipelines of contiguous runs, one per device (see
  :mod:`tfnb.placement.optimal`), for ``objective="latency"`` or ``"throughput"``. ``greedy``
  may visit a device twice, outside that form: when its plan (or ``memory``'s) predicts better,
  that plan is returned, so ``optimal`` is never predicted worse than a baseline. For
  ``"throughput"`` the search minimises the busiest resource, and the latency-optimal pipeline
  competes too: the runtime's lanes go round every stage and hop each step
  (:func:`~tfnb.placement.cost.predict`'s ``lane_s``), so on slow links the shortest round can be
  the faster; of the candidates, the one predicted fastest is returned. With too many
  kinds of device to search every order (16 all different), a beam search replaces the exact
  one, with a warning.

All modes respect memory caps that include the KV cache for ``batch`` x ``context_len``.
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np

from tfnb.errors import PlacementError
from tfnb.names import OBJECTIVES, PLANNERS, format_bytes, short_device
from tfnb.placement import measure
from tfnb.placement.cost import (
    Topology,
    check_load,
    check_requests,
    parse_rate,
    predict,
    predict_replicated,
    stage_memory,
)
from tfnb.placement.optimal import TooLarge, exact_is_feasible, optimal_segments
from tfnb.placement.plan import Plan

BEAM = 16  # states kept per level when the exact search is too large (200 stages x 16 kinds: < 1 s)

__all__ = ["plan", "memory_assignment", "greedy_assignment", "optimal_assignment",
           "replica_groups", "replicate_assignment", "as_topology", "describe_cluster",
           "topology_timer", "attended_context", "mean_attended"]


def _chain(model_or_chain):
    chain = getattr(model_or_chain, "chain", model_or_chain)
    if not (hasattr(chain, "names") and hasattr(chain, "kv_bytes")):
        raise PlacementError(f"model={model_or_chain!r:.60}: expected a LayerChain or a model "
                             "with .chain")
    return chain


def as_topology(cluster_or_topology, model=None, batch: int = 1,
                context_len: int | None = None, prompt_len: int = 0,
                devices=None, new_tokens: int = 0, route=None) -> Topology:
    """A ``Topology`` from a Topology, a connected ``Cluster`` (measured, cached) or devices.

    With a cluster and a placeable llama ``model`` (``tfnb.load_model``, ``tiny("llama")``), the
    topology also carries the stage times measured on the cluster for ``batch`` and
    ``context_len`` (:func:`tfnb.placement.measure.calibrate`), which replace the FLOP-based
    estimate, and with ``prompt_len`` the times of one prompt's prefill. With ``new_tokens``
    too the decode steps are timed over the caches such requests reach
    (:func:`attended_context`), not the whole ``context_len``, each step reading what such a
    request reads on average (:func:`mean_attended`); a packed model's stages are timed on the
    matmul ``route`` placing will give them (``tfnb.place``'s). A list of device
    strings gives a topology with unlimited memory, equal speeds and equal links (placement then
    only balances the chain). ``devices`` (with a cluster) measures those of its devices only.

    Examples
    --------
    >>> as_topology(["a", "b"]).devices
    ('a', 'b')
    """
    is_cluster = hasattr(cluster_or_topology, "devices") and hasattr(cluster_or_topology, "status")
    if devices is not None:
        known = list(cluster_or_topology.devices) if is_cluster else None
        if known is None or isinstance(devices, str) or not devices or \
                any(d not in known for d in devices) or len(set(devices)) != len(devices):
            raise PlacementError(f"devices={devices!r:.120}: expected distinct devices of the "
                                 f"cluster ({known if known is not None else 'with a Cluster'})")
    if isinstance(cluster_or_topology, Topology):
        return cluster_or_topology
    if is_cluster:
        topo = measure.measure_topology(cluster_or_topology, devices)
        if _placeable(model):
            topo = _with_times(topo, [measure.calibrate(model, cluster_or_topology, topo,
                                                        route=route, **load)
                                      for load in _loads(batch, context_len, prompt_len,
                                                         new_tokens)])
        return topo
    if isinstance(cluster_or_topology, (list, tuple, str)):
        return Topology(cluster_or_topology)
    raise PlacementError(f"cluster={cluster_or_topology!r:.60}: expected a Cluster, a Topology "
                         "or a list of device strings")


def describe_cluster(hosts, memory, *, flops=None, memory_bandwidth=None, latency=None,
                     bandwidth=None, like=None) -> Topology:
    """A cluster that is described, not connected: the :class:`Topology` ``tfnb.plan`` takes to
    say whether a model fits and how fast it would run before any machine is started.

    Parameters
    ----------
    hosts : int or list of str
        That many hosts (``host0``, ``host1``, ...), or their names.
    memory : bytes or str, list or dict
        What each host gives its worker (``"24GB"``; one for all, one per host, or a dict).
    flops : FLOP/s per host, optional
        Omitted: ``like``'s, else compute is taken as never the limit.
    memory_bandwidth : bytes/s per host (``"50GB/s"``), optional
        A decode step reads every weight of its stages once, so this sets its time
        (:mod:`tfnb.placement.cost`). Omitted: ``like``'s.
    latency, bandwidth : optional
        Seconds per hop and bytes/s (``"1.25GB/s"``) of the links between hosts, a scalar or a
        matrix. Omitted: ``like``'s mean link, else ``Topology``'s defaults.
    like : Topology, optional
        Speeds to reuse, such as a measured cluster's
        (``measure_topology(cluster).with_memory_bandwidth(memory_bandwidth(cluster))``): every
        host takes the mean FLOP/s and memory bandwidth of its devices, and its mean link.

    Examples
    --------
    >>> topo = describe_cluster(4, "24GB", flops=1e12, memory_bandwidth="50GB/s")
    >>> topo.devices, topo.memory.tolist()[0], topo.memory_bandwidth.tolist()[0]
    (('host0', 'host1', 'host2', 'host3'), 24000000000.0, 50000000000.0)
    >>> describe_cluster(["a", "b"], "8GB", like=topo).memory_bandwidth.tolist()
    [50000000000.0, 50000000000.0]
    """
    if isinstance(hosts, bool) or not isinstance(hosts, (int, list, tuple)) or \
            (isinstance(hosts, int) and hosts < 1):
        raise PlacementError(f"hosts={hosts!r:.80}: expected a number of hosts >= 1 or a list "
                             "of their names")
    names = [f"host{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
    if like is not None and not isinstance(like, Topology):
        raise PlacementError(f"like={like!r:.80}: expected a Topology (measured or described) "
                             "whose speeds the hosts take")
    if flops is None and memory_bandwidth is None and like is None:
        raise PlacementError("describe_cluster: no speed given: expected memory_bandwidth "
                             "(e.g. '50GB/s') and flops, or like=a measured Topology")
    kw = {}
    if like is not None:
        off = ~np.eye(len(like.devices), dtype=bool)
        kw = dict(flops=float(like.flops.mean()))
        if like.memory_bandwidth is not None:
            kw["memory_bandwidth"] = float(like.memory_bandwidth.mean())
        if off.any():
            kw.update(latency=float(like.latency[off].mean()),
                      bandwidth=float(like.bandwidth[off].mean()))
    given = dict(flops=flops, memory_bandwidth=memory_bandwidth, latency=latency,
                 bandwidth=parse_rate(bandwidth, "bandwidth") if isinstance(bandwidth, str)
                 else bandwidth)
    kw.update({k: v for k, v in given.items() if v is not None})
    kw.setdefault("flops", math.inf)
    return Topology(names, memory=memory, **kw)


def topology_timer(cluster, model, batch: int = 1, context_len: int | None = None,
                   prompt_len: int = 0, devices=None, new_tokens: int = 0):
    """``timer(repeats=None)``: the ``Topology`` :func:`as_topology` makes for these arguments,
    its stages timed anew at every call (:func:`tfnb.placement.measure.calibration_timer`;
    the timed loops are built once). A benchmark calls it between its rounds, so the
    prediction it makes from the times sees the machine as the rounds do."""
    if not _placeable(model):
        raise PlacementError(f"model={model!r:.60}: expected a placeable llama model to time")
    topo = as_topology(cluster, None, devices=devices)
    timers = [measure.calibration_timer(model, cluster, topo, **load)
              for load in _loads(batch, context_len, prompt_len, new_tokens)]
    return lambda repeats=None: _with_times(topo, [t(repeats) for t in timers])


def _loads(batch: int, context_len: int | None, prompt_len: int, new_tokens: int) -> list:
    """Calibration's arguments for requests of this shape: their decode steps, and with a
    prompt its prefill."""
    batch, context_len = check_load(batch, context_len)
    loads = [dict(batch=batch, context_len=attended_context(context_len, prompt_len, new_tokens),
                  attend=mean_attended(context_len, prompt_len, new_tokens))]
    if prompt_len:
        loads.append(dict(context_len=context_len, prompt_len=prompt_len))
    return loads


def _with_times(topo: Topology, tables: list) -> Topology:
    """``topo`` with the decode step times of ``tables[0]`` and the prefill times of
    ``tables[1]`` if given (:func:`_loads`' order)."""
    topo = topo.with_stage_times(tables[0])
    return topo.with_prefill_times(tables[1]) if len(tables) > 1 else topo


def attended_context(context_len: int, prompt_len: int = 0, new_tokens: int = 0) -> int:
    """The KV slots a decode step attends: ``context_len``, or for served requests of
    ``prompt_len`` + ``new_tokens`` tokens the most they reach (the prompt padded as the
    runtime pads it), at most ``context_len``.

    A served model's caches are larger than its requests (256 slots at least), and its decode
    steps attend only the window the busy rows reach (:mod:`tfnb.runtime.scheduler`), so
    that is what calibration times: a step's time grows with the window it attends
    (docs/placement.md).

    >>> attended_context(256, 37, 48), attended_context(1024), attended_context(64, 37, 48)
    (96, 1024, 64)
    """
    if not (prompt_len and new_tokens):
        return context_len
    from tfnb.runtime.requests import bucket  # the runtime's padding of a prompt

    return min(context_len, bucket(prompt_len, 16) + new_tokens)


def mean_attended(context_len: int, prompt_len: int = 0, new_tokens: int = 0) -> int:
    """The slots a decode step reads on average: ``context_len``, or for served requests of
    ``prompt_len`` + ``new_tokens`` tokens their prompt and half their new tokens (a packed
    model's attention reads a row's own slots only, in place), at most ``context_len``.

    >>> mean_attended(256, 37, 48), mean_attended(1024), mean_attended(40, 37, 48)
    (61, 1024, 40)
    """
    if not (prompt_len and new_tokens):
        return context_len
    return min(context_len, prompt_len + new_tokens // 2)


def _placeable(model) -> bool:
    """Whether the runtime can time ``model``'s stages (a llama model with its weights)."""
    return getattr(model, "arch", None) == "llama" and hasattr(model, "config") \
        and getattr(model, "weights", None) is not None


def _short(nbytes: float) -> str:
    """``"151 MB short (150,734,208 bytes)"``: a shortfall, rounded and exact."""
    return f"{format_bytes(nbytes, 'MB')} short ({math.ceil(nbytes):,} bytes)"


def _split_shortfall(needs: list, caps) -> int:
    """Bytes which, added to every cap, let stages of ``needs`` (in order) fill the devices in
    runs, the largest device first: the least such for devices of one size."""
    caps = sorted((float(c) for c in caps), reverse=True)

    def fits(extra):
        k, used = 0, 0
        for need in needs:
            while used + need > caps[k] + extra:
                k, used = k + 1, 0
                if k == len(caps):
                    return False
            used += need
        return True

    lo, hi = 0, int(sum(needs)) + 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def _check_fits(chain, topo: Topology, batch: int, context_len: int) -> None:
    """PlacementError saying where and by how much the chain cannot fit, if it cannot."""
    params = chain.total_param_bytes
    kv = sum(chain.kv_bytes(batch, context_len).values())
    total = float(topo.memory.sum())
    if params + kv > total:
        n = len(topo.devices)
        where = f"the largest device set (all {n} devices)" if n > 1 else "the one device"
        raise PlacementError(
            f"the model needs {format_bytes(params, 'MB')} + {format_bytes(kv, 'MB')} KV (batch "
            f"{batch}, context {context_len}), {where} has {format_bytes(total, 'MB')}: "
            f"{_short(params + kv - total)}")
    needs = stage_memory(chain, batch, context_len)
    k = max(range(len(needs)), key=needs.__getitem__)
    big = int(topo.memory.argmax())
    if needs[k] > topo.memory[big]:
        raise PlacementError(
            f"stage {chain.names[k]!r} needs {format_bytes(needs[k], 'MB')} with its KV cache, "
            f"the largest device ({short_device(topo.devices[big])}) has "
            f"{format_bytes(topo.memory[big], 'MB')}: {_short(needs[k] - topo.memory[big])} (a "
            "stage is never split)")


def _copy_short(chain, topo: Topology, share: int, context_len: int) -> str | None:
    """Why a full copy with ``share`` sequences of KV cache does not fit some device, or None."""
    need = sum(stage_memory(chain, share, context_len))
    kv = sum(chain.kv_bytes(share, context_len).values())
    for dev, cap in zip(topo.devices, topo.memory):
        if need > cap:
            return (f"a full copy needs {format_bytes(need - kv, 'MB')} + "
                    f"{format_bytes(kv, 'MB')} KV (batch share {share}), device {dev!r} has "
                    f"{format_bytes(cap, 'MB')}: {format_bytes(need - cap, 'MB')} short")
    return None


def replica_groups(chain, topo: Topology, batch: int = 1,
                   context_len: int = 0) -> list[tuple[str, ...]]:
    """The devices of each copy of a replicated plan: every device alone when a full copy fits
    each, else consecutive groups of the fewest devices that hold a
    copy between them (at least two groups; devices left over stay out).

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> chain = tiny("llama").chain
    >>> half = sum(s.param_bytes for s in chain) * 0.6
    >>> replica_groups(chain, Topology(list("abcde"), memory=half), context_len=0)
    [('a', 'b'), ('c', 'd')]
    """
    n = len(topo.devices)
    short = _copy_short(chain, topo, math.ceil(batch / n), context_len)
    if not short:
        return [(d,) for d in topo.devices]
    for k in range(2, n // 2 + 1):
        groups = [topo.devices[i * k:(i + 1) * k] for i in range(n // k)]
        share = math.ceil(batch / len(groups))
        try:
            for g in groups:
                _check_fits(chain, topo.subset(g), share, context_len)
                optimal_assignment(chain, topo.subset(g), share, context_len)
        except PlacementError:
            continue
        return groups
    groups = f", nor does any group of up to {n // 2} consecutive devices of the {n}" \
        if n >= 4 else ""
    raise PlacementError(f"replicate: {short}{groups} (a replicated plan makes 2 copies at "
                         "least); mode='optimal' splits the model instead")


def replicate_assignment(chain, topo: Topology, groups, batch: int = 1, context_len: int = 0,
                         objective: str = "latency") -> tuple[dict, tuple]:
    """``(assignment, replicas)`` of a replicated plan over ``groups``
    (:func:`replica_groups`). A group of one device holds its copy whole. Larger groups run one
    cut, each device in the place of the first group's device at its position: the
    :func:`optimal_assignment` of some group (its share of the batch, ``objective``), of those
    that fit every group the one predicted best over all of them."""
    share = math.ceil(batch / len(groups))
    if len(groups[0]) == 1:
        return dict.fromkeys(chain.names, groups[0][0]), tuple(g[0] for g in groups)
    best = None
    for g in groups:
        cut = optimal_assignment(chain, topo.subset(g), share, context_len, objective)
        used = [g.index(d) for d in dict.fromkeys(cut[s] for s in chain.names)]
        replicas = tuple(tuple(h[i] for i in used) for h in groups)
        copies = [{s: h[g.index(d)] for s, d in cut.items()} for h in groups]
        p = predict_replicated(chain, copies, topo, batch, context_len)
        if p.over_memory():
            continue
        value = p.latency_s if objective == "latency" else -p.throughput
        if best is None or value < best[0]:
            best = (value, copies[0], replicas)
    if best is None:
        raise PlacementError(f"replicate: no group's cut fits every group of {len(groups[0])} "
                             "devices (their memory differs); mode='optimal' splits the model "
                             "instead")
    return best[1], best[2]


def memory_assignment(chain, topo: Topology, batch: int = 1, context_len: int = 0) -> dict:
    """Accelerate-style sequential fill by bytes (see the module docstring).

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> topo = Topology(["gpu", "cpu"], memory=["200kB", "1MB"])
    >>> memory_assignment(tiny("llama").chain, topo)
    {'embed': 'gpu', 'block.0': 'gpu', 'block.1': 'cpu', 'head': 'cpu'}
    """
    order = sorted(range(len(topo.devices)),
                   key=lambda d: not any(t in topo.devices[d].upper() for t in ("GPU", "TPU")))
    out, cur, used = {}, 0, 0
    for stage, need in zip(chain, stage_memory(chain, batch, context_len)):
        while used + need > topo.memory[order[cur]]:
            cur, used = cur + 1, 0
            if cur == len(order):
                raise PlacementError(
                    f"memory planner: stage {stage.name!r} ({format_bytes(need, 'MB')}) does not "
                    "fit on any device left after filling in order; mode='optimal' may still "
                    "find a split")
        out[stage.name] = topo.devices[order[cur]]
        used += need
    return out


def greedy_assignment(chain, topo: Topology, batch: int = 1, context_len: int = 0) -> dict:
    """The whitepaper's earliest-finish rule (see the module docstring).

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> topo = Topology(["slow", "fast"], flops=[1e9, 4e9], latency=1e-6)
    >>> greedy_assignment(tiny("llama").chain, topo)   # embed costs 0 anywhere: first device wins
    {'embed': 'slow', 'block.0': 'fast', 'block.1': 'fast', 'head': 'fast'}
    """
    free = topo.memory.astype(float).copy()
    busy_until = [0.0] * len(topo.devices)
    out, prev, ready = {}, None, 0.0
    for k, (stage, need) in enumerate(zip(chain, stage_memory(chain, batch, context_len))):
        best = None
        for d in range(len(topo.devices)):
            if need > free[d]:
                continue
            arrive = ready if prev is None else ready + topo.link_s(
                prev, d, batch * chain[k - 1].act_bytes_out_per_token)
            finish = max(arrive, busy_until[d]) + topo.stage_s(stage, d, batch, context_len)
            if best is None or finish < best[0]:
                best = (finish, d)
        if best is None:
            d = int(free.argmax())
            raise PlacementError(
                f"greedy planner: stage {stage.name!r} needs {format_bytes(need, 'MB')} and the "
                f"most room left is {format_bytes(free[d], 'MB')} on "
                f"{short_device(topo.devices[d])}; mode='optimal' may still find a split")
        ready, prev = best
        busy_until[prev] = ready
        free[prev] -= need
        out[stage.name] = topo.devices[prev]
    return out


def optimal_assignment(chain, topo: Topology, batch: int = 1, context_len: int = 0,
                       objective: str = "latency") -> dict:
    """The best pipeline for ``objective`` (see :mod:`tfnb.placement.optimal`).

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> topo = Topology(["a", "b"], memory="250kB", flops=[1e9, 4e9])
    >>> optimal_assignment(tiny("llama").chain, topo, context_len=16)
    {'embed': 'a', 'block.0': 'a', 'block.1': 'b', 'head': 'b'}
    """
    def value(assignment):  # seconds per step: of one batch, or per batch of the pipeline
        p = predict(chain, assignment, topo, batch, context_len)
        return p.latency_s if objective == "latency" else max(p.bottleneck_s, p.lane_s)

    baselines = []  # (value, assignment): a pipeline must beat these to be returned
    for planner in (memory_assignment, greedy_assignment):
        try:
            a = planner(chain, topo, batch, context_len)
        except PlacementError:
            continue
        baselines.append((value(a), a))
    bound = min((v for v, _ in baselines), default=math.inf)
    # For throughput the search minimises the busiest resource; the runtime's lanes also bound
    # the rate by the round's length (predict's lane_s), which the latency-optimal pipeline
    # keeps shortest, so that one is a candidate too (on slow links it can be the faster).
    searches = [(objective, bound)] + ([("latency", math.inf)] if objective != "latency" else [])
    found = []
    exact = exact_is_feasible(topo, len(chain))
    for goal, limit in searches:
        segs = None
        if exact:
            try:
                segs, _ = optimal_segments(chain, topo, batch, context_len, goal, limit)
            except TooLarge:
                exact = False
        if not exact:
            if goal == objective:
                warnings.warn(f"optimal planner: {len(topo.classes())} kinds of device among "
                              f"{len(topo.devices)} are too many to search every order "
                              f"exactly; a beam search of width {BEAM} found this plan (the "
                              "best found, not proven optimal). Devices of one kind described "
                              "identically keep the search exact.", stacklevel=3)
            segs, _ = optimal_segments(chain, topo, batch, context_len, goal, limit, beam=BEAM)
        if segs is not None:
            found.append({chain.names[k]: dev for dev, i, j in segs for k in range(i, j)})
    candidates = [(value(a), a) for a in found] + baselines
    if not candidates:
        needs = stage_memory(chain, batch, context_len)
        short = _split_shortfall(needs, topo.memory)
        raise PlacementError(
            f"no split of the {len(chain)} stages into contiguous runs, one per device, fits "
            f"the memory caps ({format_bytes(sum(needs), 'MB')} needed, "
            f"{format_bytes(float(topo.memory.sum()), 'MB')} in all; stages are never split)"
            + (f": {short:,} bytes more on every device would hold them" if short else ""))
    least = min(v for v, _ in candidates)  # ties (within float rounding): the pipeline found,
    return next(a for v, a in candidates if v <= least * (1 + 1e-9))  # the most even of them


def plan(model_or_chain, cluster_or_topology, mode: str = "optimal", objective: str = "latency",
         batch: int = 1, context_len: int | None = None, max_memory: dict | None = None,
         calibrate: bool = True, prompt_len: int = 0, new_tokens: int = 0,
         devices=None, route=None) -> Plan:
    """Choose devices for every stage of a model and predict what it costs.

    Parameters
    ----------
    model_or_chain : a ``Model`` (its ``.chain`` is used) or a ``LayerChain``
    cluster_or_topology : a connected ``Cluster`` (measured once, cached), a ``Topology`` (such
        as :func:`describe_cluster` gives for machines not at hand) or a list of device strings
    mode : ``"optimal"``, ``"greedy"``, ``"memory"`` or ``"replicate"`` (a full copy per device,
        or per group of devices when one cannot hold it: :func:`replica_groups`)
    objective : ``"latency"`` (seconds per token) or ``"throughput"`` (tokens per second of the
        pipeline: its busiest resource and its lanes' round)
    batch, context_len : the load the memory caps (KV cache) and costs are computed for;
        ``context_len=None`` means ``DEFAULT_CONTEXT_LEN``
    max_memory : ``{device: bytes or "512MB"}``, or one cap for every device, replacing the
        measured caps
    calibrate : with a cluster and a llama model, time its stages on the cluster's devices
        (once per cluster, model and load; cached) instead of estimating them from FLOPs
    prompt_len, new_tokens : the requests a served model gets (both or neither): the
        prediction's ``throughput`` then counts each request's prefill (timed too when
        calibrating) beside its ``new_tokens`` decode steps, timed attending the requests'
        own tokens (:func:`attended_context`); the stages are still chosen by the decode step
    devices : with a cluster, plan on these of its devices only (default: all of them)
    route : the ``route`` the plan will be placed with (``tfnb.place``'s; default auto): a
        packed model's stages are timed on it

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> topo = Topology(["a", "b"], memory="250kB", flops=[1e9, 4e9])
    >>> p = plan(tiny("llama"), topo, context_len=16)
    >>> p.segments()
    [Segment(a: embed .. block.0 (2)), Segment(b: block.1 .. head (2))]
    """
    if mode not in PLANNERS:
        raise PlacementError(f"mode={mode!r}: expected one of {list(PLANNERS)}")
    if objective not in OBJECTIVES:
        raise PlacementError(f"objective={objective!r}: expected one of {list(OBJECTIVES)}")
    chain = _chain(model_or_chain)
    batch, context_len = check_load(batch, context_len)
    prompt_len, new_tokens = check_requests(prompt_len, new_tokens)
    # a replicated plan splits the batch over the copies: each copy's steps run at its share,
    # so the copies (which memory alone decides) are found before any stage is timed
    share, groups = batch, None
    if mode == "replicate":
        bare = as_topology(cluster_or_topology, None, devices=devices).with_max_memory(max_memory)
        groups = replica_groups(chain, bare, batch, context_len)
        share = math.ceil(batch / len(groups))
    topo = as_topology(cluster_or_topology, model_or_chain if calibrate else None, share,
                       context_len, prompt_len, devices, new_tokens,
                       route).with_max_memory(max_memory)
    start = time.perf_counter()
    replicas = ()
    if mode == "replicate":
        assignment, replicas = replicate_assignment(chain, topo, groups, batch, context_len,
                                                    objective)
    else:
        _check_fits(chain, topo, batch, context_len)
        if mode == "memory":
            assignment = memory_assignment(chain, topo, batch, context_len)
        elif mode == "greedy":
            assignment = greedy_assignment(chain, topo, batch, context_len)
        else:
            assignment = optimal_assignment(chain, topo, batch, context_len, objective)
    took = time.perf_counter() - start
    return Plan.from_assignment(chain, assignment, topo, batch, context_len, mode, objective,
                                replicas, took, prompt_len, new_tokens)
