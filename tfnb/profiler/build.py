"""From the raw XSpaces of one capture to the event records a :class:`Profile` holds.

How TF 2.21 traces transfers (as seen in the runtime's decode loop, :mod:`tfnb.runtime.graphs`):

* a ``_Send``/``_Recv`` names its producing node (``from``), its consuming node (``to``) and a
  rendezvous ``key`` but no size. The key is fixed per node: inside a ``tf.while_loop`` one
  node transfers once per iteration under the same key and step, so every event is one
  transfer, not every (key, step);
* on the loop's last iteration the body's ``_Send``/``_Recv`` still run, to pass *deadness*
  on: such a transfer carries no tensor and its consumer does not run. So the live transfers
  of a (key, step) are as many as the runs of the consumer (else of the producer); the rest
  are dead and not counted;
* the size is the consumer's input that comes from the producer, in the consumer's traced
  ``shape`` stat; which input that is comes from the function library (:mod:`library`). A
  *control* edge crossing devices is sent as a dummy ``float[0]`` received into an
  ``Identity`` numbered one above the ``_Recv`` (``x/_19`` -> ``x/_20``); a loop's ``LoopCond``
  reaches the other devices' control loops as a bool, sized from the producer's own input;
* a key between two devices of one process (``/device:CPU:0`` both ends, as the constant
  folding of an XLA compilation runs) is no transfer: those events count as compute.

Each transfer is counted once, at its ``_Recv`` when the destination was traced, else at its
``_Send``.
"""
from __future__ import annotations

import re

from tfnb.profiler.library import Library
from tfnb.profiler.xplane import (
    TRANSFER_TYPES,
    Event,
    key_devices,
    parse_space,
    start_time_ns,
    transfer_bytes,
)

_RECV = frozenset({"_Recv", "_HostRecv"})
_PASS_THROUGH = frozenset({"LoopCond", "Identity", "Enter", "Exit", "NextIteration", "Snapshot"})
_NOT_ONE_PER_VALUE = frozenset({"Merge", "Switch"})  # run on any live input / output one dead
_NUMBERED = re.compile(r"^(.*)/_(\d+)$")


def _device_namer(task: str):
    def device_of(plane: str):
        if plane == "/host:CPU":
            return f"{task}/device:CPU:0"
        if plane.startswith("/device:") and plane.rsplit(":", 1)[-1].isdigit():
            return f"{task}{plane}"
        return None
    return device_of


def _input_bytes(run: dict, index: int | None) -> int | None:
    return transfer_bytes(run["stats"].get("shape") if run["stats"] else None, index)


class _Sizer:
    """Live transfers and their sizes for each (key, step) group of transfer events."""

    def __init__(self, records, functions, library):
        self.functions, self.library = functions, library
        self.runs: dict = {}  # (device, step, node) -> op events in time order
        for r in records:
            if r["op"] not in TRANSFER_TYPES:
                self.runs.setdefault((r["device"], r["step"], r["name"]), []).append(r)
        self.index_cache: dict = {}

    def _index(self, step, src_node, dst_node):
        key = (self.functions.get(step), src_node, dst_node)
        if key not in self.index_cache:
            self.index_cache[key] = self.library.input_index(key[0], src_node, dst_node)
        return self.index_cache[key]

    def sizes(self, stats: dict, step, recv_name: str | None) -> list[int | None] | None:
        """Bytes of each live transfer in time order; None when liveness cannot be told."""
        src_node, dst_node = stats.get("from"), stats.get("to")
        m = _NUMBERED.match(recv_name or "")
        if m:  # a control edge: the Recv feeds an Identity named one number up
            ident = self.runs.get((stats["dst"], step, f"{m.group(1)}/_{int(m.group(2)) + 1}"), [])
            ident = [r for r in ident if r["op"] == "Identity"
                     and (r["stats"] or {}).get("shape") == "(float[0])"]
            if ident:
                return [_input_bytes(r, 0) for r in ident]
        producers = [r for r in self.runs.get((stats["src"], step, src_node), [])
                     if r["op"] not in _NOT_ONE_PER_VALUE]
        consumers = [r for r in self.runs.get((stats["dst"], step, dst_node), [])
                     if r["op"] not in ("Merge",)]
        passed = [_input_bytes(r, 0) for r in producers if r["op"] in _PASS_THROUGH]
        if consumers:
            index = self._index(step, src_node, dst_node)
            out = [_input_bytes(r, index) for r in consumers]
            if index is None and len(passed) == len(out):
                out = [a if a is not None else b for a, b in zip(out, passed)]
            return out
        if producers:
            return passed if len(passed) == len(producers) else [None] * len(producers)
        return None


def clock_shift(start: int | None, t0: int, t1: int) -> int:
    """What to add to a host's clock: its session started at ``start`` (its clock), between
    ``t0`` and ``t1`` on this process's clock; 0 when that is within the uncertainty."""
    if start is None:
        return 0
    offset = start - (t0 + t1) // 2
    return 0 if abs(offset) <= (t1 - t0) // 2 else -offset


def build(raw: dict, library: Library | None = None) -> dict:
    """Events (aligned, clipped to the capture window), functions per step and transfer sizes."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    t_begin, t_end = raw["t_begin"], raw["t_end"]
    records, functions, shifts, compiled, compiles = [], {}, {}, [], []
    for host, (task, data, (t0, t1)) in raw["spaces"].items():
        space = xplane_pb2.XSpace.FromString(data)
        shifts[host] = shift = clock_shift(start_time_ns(space), t0, t1)
        parsed = parse_space(space, _device_namer(task), shift_ns=shift - t_begin)
        records.extend(parsed.ops)
        functions.update(parsed.functions)
        compiled.extend(parsed.compiled)
        compiles.extend(parsed.compiles)
    window = t_end - t_begin

    def inside(rows):
        return sorted((r for r in rows if r["start"] + r["dur"] > 0 and r["start"] < window),
                      key=lambda r: r["start"])
    records, compiled, compiles = inside(records), inside(compiled), inside(compiles)

    groups: dict = {}
    for r in records:
        st = r["stats"]
        if r["op"] not in TRANSFER_TYPES or not st or "key" not in st:
            continue
        ends = key_devices(str(st["key"]), r["device"].partition("/device:")[0])
        if ends is None or ends[0] == ends[1]:
            r["local"] = True  # same device: no transfer
            continue
        st.update(src=ends[0], dst=ends[1], counted=False)
        g = groups.setdefault((st["key"], r["step"]), ([], []))
        g[0 if r["op"] in _RECV else 1].append(r)
    sizer = _Sizer(records, functions, library or Library())
    for (_key, step), (recvs, sends) in groups.items():
        side = sorted(recvs or sends, key=lambda r: r["start"])
        sizes = sizer.sizes(side[0]["stats"], step, side[0]["name"] if recvs else None)
        if sizes is None:
            sizes = [None] * len(side)
        for i, r in enumerate(side):  # dead transfers come last (the loop's exit)
            live = i < len(sizes)
            r["stats"].update(counted=live, dead=not live, bytes=sizes[i] if live else 0)
        for r in (sends if recvs else ()):
            r["stats"]["counted"] = False
    events = [Event(r["device"], r["thread"], r["name"], r["op"], r["start"], r["dur"], r["step"],
                    "send/receive" if r["op"] in TRANSFER_TYPES and not r.get("local")
                    else "compute",
                    r["stats"])
              for r in sorted(records, key=lambda r: r["start"])]
    offsets = {host: -shift for host, shift in shifts.items()}
    return {"events": events, "functions": functions, "window_ns": window, "offsets_ns": offsets,
            "compiled": compiled, "compiles": compiles}
