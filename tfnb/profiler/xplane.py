"""Turn TensorFlow's XSpace protos into flat, aligned event records.

What the traces hold (probed on TF 2.21, host tracer level 3 on CPU workers):

* op events are named ``"node:OpType"`` (``MatMul:MatMul``, ``MatMul/_1:_Send``) and, at level 3,
  carry a ``shape`` stat with the dtype and shape of every *input*: ``(float[8,64];float[64,64])``
  (a resource input is an empty entry); an XLA-compiled call is one ``StatefulPartitionedCall``
  event with the shapes of its inputs, its HLO ops separate events without ``:``;
* ``_Send`` / ``_Recv`` carry ``from`` (producing node), ``to`` (consuming node) and ``key``
  (``src_device;incarnation;dst_device;edge_name;frame:iter``, the same for every iteration of
  a loop) but no size; the size of a transfer is the size of the consumer's input that comes
  from ``from`` (see build.py);
* every op runs inside an ``ExecutorState::Process`` event whose ``id`` stat is the step id, and
  that id is the same on every worker for one call of a multi-device function;
* the ``Task Environment`` plane reports ``profile_start_time`` (ns since the epoch, the host's
  own clock) and line timestamps are relative to it.
"""
from __future__ import annotations

import bisect
import re
from typing import NamedTuple

TRANSFER_TYPES = frozenset({"_Send", "_Recv", "_HostSend", "_HostRecv"})
_DTYPE_BYTES = {"float": 4, "double": 8, "half": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
                "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
                "bool": 1, "complex64": 8, "complex128": 16, "qint8": 1, "quint8": 1, "qint32": 4}
# Op kinds a person reads a profile by. The op type of one idea differs with the kernel library
# TensorFlow picked: a matmul is "MatMul" with Eigen kernels but "_MklMatMul" or "_FusedMatMul"
# where oneDNN's kernels are registered (x86 builds with AVX-512), so kinds match by pattern.
OP_KINDS = (
    ("matmul", re.compile(r"MatMul|Einsum|^dot$|Conv", re.IGNORECASE)),
    ("compiled", re.compile(r"PartitionedCall|^_?Xla(Launch|Run|Compile)")),
)


def op_kind(op: str) -> str:
    """The kind of an op type: "transfer", "matmul", "compiled" (an XLA segment) or "other".

    Examples
    --------
    >>> [op_kind(t) for t in ("MatMul", "_MklMatMul", "_Recv", "Relu")]
    ['matmul', 'matmul', 'transfer', 'other']
    """
    if op in TRANSFER_TYPES:
        return "transfer"
    return next((kind for kind, pattern in OP_KINDS if pattern.search(op)), "other")


_PARTITION = re.compile(r"^(.*?)_partitioned_\d+_\d+$")
_EPOCH_NS = 10**15  # line timestamps below this are relative to profile_start_time
_OP, _EXEC, _RUN, _EAGER = range(4)  # kinds of event parse_space keeps


class Event(NamedTuple):
    """One traced op on one device, times in ns on the merged (client) time axis."""
    device: str
    thread: str
    name: str       # node name, e.g. "MatMul/_1"
    op: str         # op type, e.g. "_Send"
    start: int      # ns since the capture window opened
    dur: int        # ns
    step: int | None
    category: str   # "compute" or "send/receive"
    stats: dict | None  # transfers: from, to, key (+ bytes); others: shape when traced


def _stat_value(stat, names):
    kind = stat.WhichOneof("value")
    if kind is None:
        return None
    value = getattr(stat, kind)
    return names.get(value, value) if kind == "ref_value" else value


def start_time_ns(space) -> int | None:
    """``profile_start_time`` of an XSpace (the host's clock), or None when it is not reported."""
    for plane in space.planes:
        names = {k: v.name for k, v in plane.stat_metadata.items()}
        for s in plane.stats:
            if names.get(s.metadata_id) == "profile_start_time":
                return int(_stat_value(s, names))
    return None


def _is_op(op: str, _cache: dict = {}) -> bool:
    if op not in _cache:
        from tensorflow.python.framework import op_def_registry

        _cache[op] = op_def_registry.get(op) is not None
    return _cache[op]


def parse_space(space, device_of, *, shift_ns: int) -> tuple[list[dict], dict[int, str]]:
    """Op events of one XSpace as dicts with absolute times (host clock + ``shift_ns``).

    ``device_of(plane_name)`` names the TF device of a plane (None: skip the plane). Returns the
    events and ``{step id: function name}`` for the steps that started a function here.
    """
    base = start_time_ns(space) or 0
    out, functions = [], {}
    for plane in space.planes:
        device = device_of(plane.name)
        if device is None:
            continue
        meta = plane.event_metadata
        snames = {k: v.name for k, v in plane.stat_metadata.items()}
        wanted = {k: v for k, v in snames.items() if v in ("shape", "from", "to", "key")}
        id_stat = next((k for k, v in snames.items() if v == "id"), None)
        # What each event name is, decided once per name: most events of an LLM's trace are the
        # HLO ops of its XLA calls and the thread pool's own events, which are skipped here.
        kinds: dict = {}
        for mid, md in meta.items():
            name = md.name
            if name == "ExecutorState::Process":
                kinds[mid] = (_EXEC,)
            elif name == "FunctionRun":
                kinds[mid] = (_RUN,)
            elif name.startswith("EagerLocalExecute"):
                kinds[mid] = (_EAGER, name.partition(": ")[2])
            elif ":" in name and " " not in name and "::" not in name:
                node, _, op = name.rpartition(":")
                if node and _is_op(op):
                    meta_stats = [s for s in md.stats if s.metadata_id in wanted] if op in TRANSFER_TYPES else []
                    kinds[mid] = (_OP, node, op, meta_stats)
        for line in plane.lines:
            t0 = line.timestamp_ns + (base if line.timestamp_ns < _EPOCH_NS else 0) + shift_ns
            thread = line.name or str(line.id)
            execs, ops, calls = [], [], []
            for e in line.events:
                kind = kinds.get(e.metadata_id)
                if kind is None:
                    continue
                start, dur = t0 + e.offset_ps // 1000, e.duration_ps // 1000
                if kind[0] == _OP:
                    found = [s for s in e.stats if s.metadata_id in wanted] + kind[3]
                    stats = {wanted[s.metadata_id]: _stat_value(s, snames) for s in found}
                    ops.append({"device": device, "thread": thread, "name": kind[1],
                                "op": kind[2], "start": start, "dur": dur, "stats": stats or None})
                elif kind[0] == _EAGER:
                    calls.append((start, start + dur, kind[1]))
                else:
                    sid = next((_stat_value(s, snames) for s in e.stats if s.metadata_id == id_stat), None)
                    if sid is not None:
                        (execs if kind[0] == _EXEC else calls).append((start, start + dur, int(sid)))
            execs.sort()
            starts = [x[0] for x in execs]
            for ev in ops:  # the step of an op: the innermost executor event around it
                i = bisect.bisect_right(starts, ev["start"]) - 1
                while i >= 0 and execs[i][1] < ev["start"] + ev["dur"]:
                    i -= 1
                ev["step"] = execs[i][2] if i >= 0 else None
            out.extend(ops)
            fn_spans = [c for c in calls if isinstance(c[2], str)]
            for s, e, sid in (c for c in calls if isinstance(c[2], int)):
                fname = next((f for fs, fe, f in fn_spans if fs <= s and e <= fe), None)
                if fname:
                    m = _PARTITION.match(fname)
                    functions[sid] = m.group(1) if m else fname
    return out, functions


def parse_shapes(text: str | None) -> list[tuple[str | None, list[int | None] | None]] | None:
    """``"(float[8,64];float[])"`` -> ``[("float", [8, 64]), ("float", [])]``.

    An empty entry (a resource handle, or an input not yet available to a ``Merge``) is
    ``(None, None)``: ``"(int32[3];;)"`` -> ``[("int32", [3]), (None, None), (None, None)]``.
    """
    if not text or not text.startswith("(") or not text.endswith(")"):
        return None
    out = []
    for part in text[1:-1].split(";"):
        if not part.strip():
            out.append((None, None))
            continue
        m = re.fullmatch(r"\s*(\w+)\[([^\]]*)\]\s*", part)
        if not m:
            return None
        dims = [int(d) if d.strip().lstrip("-").isdigit() else None for d in m.group(2).split(",") if d.strip()]
        out.append((m.group(1), dims))
    return out


def tensor_bytes(dtype: str | None, dims: list[int | None] | None) -> int | None:
    size = _DTYPE_BYTES.get(dtype) if dtype else None
    if size is None or dims is None or any(d is None or d < 0 for d in dims):
        return None
    for d in dims:
        size *= d
    return size


def transfer_bytes(consumer_shapes: str | None, index: int | None) -> int | None:
    """Bytes of the transferred tensor: the consumer's input ``index`` (or its only input, or
    any input when all inputs have the same known size)."""
    shapes = parse_shapes(consumer_shapes)
    if not shapes:
        return None
    sizes = [tensor_bytes(d, s) for d, s in shapes]
    if index is not None:
        return sizes[index] if index < len(sizes) else None
    return sizes[0] if len(set(sizes)) == 1 else None


def key_devices(key: str, task: str | None = None) -> tuple[str, str] | None:
    """``(source device, destination device)`` of a rendezvous key.

    A process-local run (constant folding while a function compiles, an eager copy) names
    its devices without a task (``/device:CPU:0``): with ``task`` they are qualified with the
    task the event was traced on.
    """
    parts = key.split(";")
    if len(parts) < 5:
        return None
    src, dst = parts[0], parts[2]
    if task:
        src, dst = (f"{task}{d}" if d.startswith("/device:") else d for d in (src, dst))
    return src, dst
