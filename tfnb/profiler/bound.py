"""How far each device is from its memory-bandwidth bound, from a profile of tfnb's runtime.

A decode step reads every weight of a device's stages once, and the keys and values of its
blocks over the attended window for every busy row; at the device's memory bandwidth that
takes at least ``bytes / bandwidth``. The profile measures the step: the compiled ops of the
device's stages per decode step (``Profile.stage_times``). Their ratio is the fraction of the
bound it runs at (100%: as fast as its memory allows). Which rows and windows the steps had
comes from the placed model's scheduler (the decode calls it made inside the profile's
window), the bytes from the placed model, the bandwidth from
:func:`tfnb.placement.measure.memory_bandwidth` (measured once per cluster).
"""
from __future__ import annotations

import sys

_MS = 1e6


def models_in(prof) -> list:
    """The placed models still alive that decoded inside the profile's window."""
    placed = sys.modules.get("tfnb.runtime.placed")
    if placed is None:  # the runtime was never imported: nothing was placed
        return []
    t0, t1 = prof.t_begin_ns, prof.t_begin_ns + prof.window_ns
    return [pm for pm in placed.live_models() if pm.scheduler.decode_chunks(t0, t1)]


def _bandwidth(cluster, devices, bandwidth):
    if bandwidth is not None:
        if isinstance(bandwidth, dict):
            return dict(bandwidth), None
        return dict.fromkeys(devices, float(bandwidth)), None
    from tfnb.errors import TfnbError
    from tfnb.placement.measure import memory_bandwidth

    try:
        if cluster is None:
            from tfnb.cluster import current

            cluster = current()
        if not getattr(cluster, "connected", False):
            return {}, "the cluster is not connected, so its memory bandwidth cannot be measured"
        return memory_bandwidth(cluster, [d for d in devices if d in cluster.devices]), None
    except TfnbError as e:
        return {}, f"memory bandwidth not measured: {e}"


def device_rows(prof, models=None, cluster=None, bandwidth=None) -> list[dict]:
    """One row per device of the models (default: those that decoded in the profile)."""
    models = models_in(prof) if models is None else list(models)
    t0, t1 = prof.t_begin_ns, prof.t_begin_ns + prof.window_ns
    stage_rows = [r for r in prof.stage_times() if r.get("steps")] if prof.compiled_stages() else []
    devices = list(dict.fromkeys(d for pm in models for d in pm.devices))
    bw, reason = _bandwidth(cluster, devices, bandwidth) if devices else ({}, None)
    rows = []
    for pm in models:
        chunks = pm.scheduler.decode_chunks(t0, t1)
        steps = sum(n for n, _, _ in chunks)
        per_shape: dict = {}
        for n, B, window in chunks:
            per_shape[(B, window)] = per_shape.get((B, window), 0) + n
        mean_rows = sum(B * n for (B, _), n in per_shape.items()) / max(steps, 1)
        read: dict = {}
        for (B, window), n in per_shape.items():
            for dev, b in pm.bytes_per_step(B, window).items():
                r = read.setdefault(dev, {"weights": 0.0, "kv_cache": 0.0})
                r["weights"] = b["weights"]
                r["kv_cache"] += b["kv_cache"] * n / max(steps, 1)
        for dev in pm.devices:
            mine = [r for r in stage_rows if r["device"] == dev]
            dev_steps = max((r["steps"] for r in mine), default=0)
            ms = sum(r["decode_ms"] for r in mine) / dev_steps if dev_steps else None
            nbytes = read[dev]["weights"] + read[dev]["kv_cache"]
            row = {"device": dev, "model": pm.name, "steps": dev_steps, "rows": mean_rows,
                   "ms_per_step": ms, "weights_bytes": read[dev]["weights"],
                   "kv_bytes": read[dev]["kv_cache"], "bytes_per_step": nbytes,
                   "bandwidth": bw.get(dev), "bound_ms": None, "fraction": None}
            if row["bandwidth"]:
                row["bound_ms"] = nbytes / row["bandwidth"] * 1e3
                row["fraction"] = row["bound_ms"] / ms if ms else None
            if row["fraction"] is None:
                row["reason"] = (reason if not row["bandwidth"] else
                                 "no compiled decode step of this device was traced")
            rows.append(row)
    return rows


def link_rows(prof, models=None, cluster=None) -> list[dict]:
    """Per link between two devices of the models: bytes per decode step and the measured
    round trip (``tfnb.placement.measure.measure_topology``, cached; None when not measured)."""
    models = models_in(prof) if models is None else list(models)
    t0, t1 = prof.t_begin_ns, prof.t_begin_ns + prof.window_ns
    devices = {d for pm in models for d in pm.devices}
    steps = max((sum(n for n, _, _ in pm.scheduler.decode_chunks(t0, t1)) for pm in models),
                default=0)
    topo = None
    try:
        from tfnb.cluster import current
        from tfnb.placement.measure import measure_topology

        cluster = cluster or current()
        if getattr(cluster, "connected", False) and len(devices) > 1:
            topo = measure_topology(cluster)
    except Exception:  # noqa: BLE001 - the round trip is optional; the bytes are not
        topo = None
    rows = []
    for t in prof.transfers():
        if t["source"] in devices and t["destination"] in devices and steps:
            rtt = None
            if topo is not None and t["source"] in topo.devices \
                    and t["destination"] in topo.devices:
                a, b = topo.index(t["source"]), topo.index(t["destination"])
                rtt = 2 * float(topo.latency[a, b]) * 1e3
            rows.append({"source": t["source"], "destination": t["destination"],
                         "bytes_per_step": t["bytes"] / steps, "rtt_ms": rtt})
    return rows


def describe(row) -> str:
    """``"worker:0/CPU:0: 71% of its memory-bandwidth bound (...)"``."""
    from tfnb.names import format_bytes, short_device

    if row["fraction"] is None:
        return f"{short_device(row['device'])}: bound unknown ({row.get('reason')})"
    return (f"{short_device(row['device'])}: {row['fraction']:.0%} of its memory-bandwidth bound "
            f"({row['ms_per_step']:.2f} ms/step; {format_bytes(row['bytes_per_step'])} read at "
            f"{row['bandwidth'] / 1e9:.1f} GB/s: {row['bound_ms']:.2f} ms)")
