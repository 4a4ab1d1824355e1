"""From the raw XSpaces of one capture to the event records a :class:`Profile` holds.

Transfer sizes: ``_Send``/``_Recv`` events name the producing node (``from``) and the consuming
node (``to``) but carry no size. The consumer's own event on the destination device, in the same
step, lists the dtype and shape of each of its inputs; which input came over the wire is read
from the consuming node's inputs in the client's function library (the FunctionDef the client
registered for the ``tf.function``). Each transfer is counted once, by (rendezvous key, step), from
its ``_Recv`` when the destination was traced, else from its ``_Send``.
"""
from __future__ import annotations

from tfnb.profiler.xplane import (TRANSFER_TYPES, Event, input_index, key_devices, parse_space,
                                  transfer_bytes)


def _device_namer(task: str):
    def device_of(plane: str):
        if plane == "/host:CPU":
            return f"{task}/device:CPU:0"
        if plane.startswith("/device:") and plane.rsplit(":", 1)[-1].isdigit():
            return f"{task}{plane}"
        return None
    return device_of


def _function_defs(names_wanted):
    """FunctionDefs of the client's eager context: the wanted ones first, then all of them."""
    try:
        from tensorflow.python.eager import context

        ctx = context.context()
        names = sorted(ctx.list_function_names())
    except Exception:  # noqa: BLE001 - no TF context: sizes stay unknown unless unambiguous
        return [], []
    wanted = [ctx.get_function_def(n) for n in names_wanted if n in names]
    return wanted, (lambda: [ctx.get_function_def(n) for n in names])


def build(raw: dict) -> dict:
    """Events (aligned, clipped to the capture window), functions per step and transfer sizes."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    t_begin, t_end = raw["t_begin"], raw["t_end"]
    records, functions = [], {}
    for host, (task, data, shift) in raw["spaces"].items():
        space = xplane_pb2.XSpace.FromString(data)
        evs, fns = parse_space(space, _device_namer(task), shift_ns=shift - t_begin)
        records.extend(evs)
        functions.update(fns)
    window = t_end - t_begin
    records = [r for r in records if r["start"] + r["dur"] > 0 and r["start"] < window]

    # consumers by (device, step, node): their traced input shapes, in time order
    consumers: dict = {}
    for r in records:
        if r["stats"] and "shape" in r["stats"]:
            consumers.setdefault((r["device"], r["step"], r["name"]), []).append((r["start"], r["stats"]["shape"]))
    seen: dict = {}
    for r in sorted(records, key=lambda r: r["op"] not in ("_Recv", "_HostRecv")):
        if r["op"] not in TRANSFER_TYPES or not r["stats"] or "key" not in r["stats"]:
            continue
        ends = key_devices(str(r["stats"]["key"]))
        if ends is None:
            continue
        ident = (r["stats"]["key"], r["step"])
        r["stats"].update(src=ends[0], dst=ends[1], counted=ident not in seen)
        if ident in seen:
            r["stats"]["bytes"] = seen[ident]
            continue
        shapes = consumers.get((ends[1], r["step"], r["stats"].get("to")), [])
        after = [s for t, s in shapes if t >= r["start"]] or [s for _, s in shapes]
        seen[ident] = r["stats"]["bytes"] = _size(after[0] if after else None, r["stats"], functions.get(r["step"]))
    events = [Event(r["device"], r["thread"], r["name"], r["op"], r["start"], r["dur"], r["step"],
                    "send/receive" if r["op"] in TRANSFER_TYPES else "compute", r["stats"])
              for r in sorted(records, key=lambda r: r["start"])]
    offsets = {host: -shift for host, (_, _, shift) in raw["spaces"].items()}
    return {"events": events, "functions": functions, "window_ns": window, "offsets_ns": offsets}


_FDEF_CACHE: dict = {}


def _size(shape_text, stats, function_name):
    if shape_text is None:
        return None
    key = (function_name, stats.get("from"), stats.get("to"))
    if key not in _FDEF_CACHE:
        wanted, everything = _function_defs([function_name] if function_name else [])
        index = input_index(wanted, stats.get("from"), stats.get("to")) if wanted else None
        if index is None and callable(everything):
            index = input_index(everything(), stats.get("from"), stats.get("to"))
        if not function_name:  # names with a tf.function's unique number are safe to cache
            return transfer_bytes(shape_text, index)
        _FDEF_CACHE[key] = index
    return transfer_bytes(shape_text, _FDEF_CACHE[key])
