"""Turn TensorFlow's XSpace protos into flat, aligned event records.

What the traces hold (TF 2.21, host tracer level 3 on CPU workers):

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
  own clock) and line timestamps are relative to it;
* an XLA call that compiles does so inside its ``StatefulPartitionedCall`` event, before it
  runs: ``HLO passes ...`` and ``CpuCompiler::RunBackend`` (``GpuCompiler::...`` on GPUs) mark
  the compiler, ``CpuExecutable::ExecuteAsyncOnStream`` the run. The call's time up to its
  last compiler event is its compile (tf2xla's lowering before them has no event of its own);
* inside an XLA call each HLO op of the executable is one event named after the instruction
  (``MatMul.4``, ``subtract_exponential_fusion``) with ``hlo_module`` and ``hlo_op`` stats, on
  the calling thread (an op that calls computations, a ``while``, spans its body's events).
  With ``enable_hlo_proto`` the ``/host:metadata`` plane holds each live module's ``HloProto``
  (one event metadata ``"module(program id)"``, stat ``Hlo Proto``) even when it was compiled
  before the session, and every instruction's ``metadata.op_name`` is the TF op's name scope
  path (``block.3/attention/einsum/Einsum``): :func:`compiled_ops` reads stages and op kinds
  from it.
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
_OP, _EXEC, _RUN, _EAGER, _HLO, _COMPILE = range(6)  # kinds of event parse_space keeps
_COMPILER = re.compile(r"Compiler::RunBackend$|Compiler::RunHloPasses$|^HLO passes")


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


# Name scopes tfnb's runtime math runs under (tfnb/runtime/forward.py) and the op kind each one is.
SCOPE_KINDS = {"attention": "attention", "norm": "norm", "rope": "rope", "kv_cache": "copies",
               "sampling": "sampling", "matmul": "matmul"}  # matmul: the XLA route's fusions
COMPILED_KINDS = ("matmul", "attention", "norm", "rope", "sampling", "copies", "other")
_STAGE = re.compile(r"^(embed|head|block\.\d+)$")
_COPY_OPCODES = frozenset({"copy", "transpose", "dynamic-update-slice", "dynamic-slice", "gather",
                           "scatter", "concatenate", "slice", "pad", "reshape", "bitcast",
                           "broadcast", "copy-start", "copy-done", "reverse"})
_CONTAINER_OPCODES = frozenset({"while", "conditional", "call", "async-start", "async-done"})
_DOT = re.compile(r"MatMul|Einsum|Dequantize")  # op types of dots, tfnb's packed-weight ops


class CompiledOp(NamedTuple):
    """What one HLO instruction is: its stage (None outside tfnb's stage scopes), op kind and
    the TF op it came from."""
    stage: str | None
    kind: str
    tf_op: str


def _scope(op_name: str) -> tuple[str | None, str | None]:
    """``(stage, kind)`` named by a TF op's name scope path (either may be None)."""
    stage, kind = None, None
    for part in op_name.split("/"):
        if stage is None and _STAGE.match(part):
            stage = part
        elif stage is not None and kind is None and part in SCOPE_KINDS:
            kind = SCOPE_KINDS[part]
    return stage, kind


def _opcode_kind(ins) -> str | None:
    if ins.opcode in ("dot", "convolution") or (ins.opcode == "custom-call" and (
            _DOT.search(ins.metadata.op_type) or "Packed" in ins.custom_call_target)):
        return "matmul"
    return "copies" if ins.opcode in _COPY_OPCODES else None


def _majority(values):
    values = [v for v in values if v is not None]
    return max(set(values), key=values.count) if values else None


_SKIP_OPCODES = _CONTAINER_OPCODES | {"parameter", "constant", "tuple", "get-tuple-element"}


_MODULES: dict = {}  # (module, size) -> compiled_ops(); each profile of the same placed model
# carries the same modules again. Keyed by the metadata plane's "name(program id)" and the
# proto's size, not its bytes: a module's serialized proto differs from one snapshot to the next.


def module_ops(module: str, hlo_proto: bytes) -> dict[str, CompiledOp]:
    """:func:`compiled_ops` of ``module`` (``"name(program id)"``), remembered (the 64 most
    recent)."""
    key = (module, len(hlo_proto))
    if key not in _MODULES:
        if len(_MODULES) >= 64:
            _MODULES.pop(next(iter(_MODULES)))
        _MODULES[key] = compiled_ops(hlo_proto)
    return _MODULES[key]


def compiled_ops(hlo_proto: bytes) -> dict[str, CompiledOp]:
    """``{instruction name: CompiledOp}`` for the leaf instructions of one serialized
    ``HloProto`` (every computation's, so a while loop's body too; ops that only call other
    computations are left out: their events span their bodies').

    An instruction's stage and kind come from its own name scope; a fusion without one takes
    the most common among the instructions it fuses. Some ops lose their metadata in XLA's
    passes (in TF 2.21: the dots an ``einsum`` becomes, the ``reduce-window`` of a
    softmax): those take the scope of the nearest op that uses their result (else of their
    operands). A kind no scope names is "matmul" for a dot (or a fusion of one) and tfnb's
    packed-weight ops, "copies" for data movement, else "other".
    """
    from tensorflow.compiler.xla.service import hlo_pb2

    module = hlo_pb2.HloProto.FromString(hlo_proto).hlo_module
    comps = {c.id: c for c in module.computations}
    inner: dict[int, list] = {}

    def inside(cid):  # (stage, scope kind, opcode kind) of each instruction a fusion holds
        if cid not in inner:
            inner[cid] = []
            for ins in comps[cid].instructions if cid in comps else ():
                if ins.opcode == "fusion":
                    for sub in ins.called_computation_ids:
                        inner[cid].extend(inside(sub))
                elif ins.opcode not in ("parameter", "constant"):
                    inner[cid].append((*_scope(ins.metadata.op_name), _opcode_kind(ins)))
        return inner[cid]

    out = {}
    for comp in module.computations:
        by_id = {ins.id: ins for ins in comp.instructions}
        users: dict = {}
        for ins in comp.instructions:
            for o in ins.operand_ids:
                users.setdefault(o, []).append(ins.id)
        own = {}
        for ins in comp.instructions:
            stage, kind = _scope(ins.metadata.op_name)
            opk = _opcode_kind(ins)
            if ins.opcode == "fusion":
                parts = [x for cid in ins.called_computation_ids for x in inside(cid)]
                stage = stage or _majority([p[0] for p in parts])
                kind = kind or _majority([p[1] for p in parts])
                opk = "matmul" if any(p[2] == "matmul" for p in parts) \
                    else (opk or _majority([p[2] for p in parts]))
            own[ins.id] = (stage, kind, opk)

        operands = {k: list(v.operand_ids) for k, v in by_id.items()}

        def nearest(iid, users=users, operands=operands, own=own):
            # the scope of the closest user with one, else of an operand
            for links in (users, operands):
                seen, frontier = {iid}, [iid]
                for _ in range(6):
                    frontier = [n for f in frontier for n in links.get(f, ()) if n not in seen]
                    seen.update(frontier)
                    found = [own[n] for n in frontier if n in own and own[n][0] is not None]
                    if found:
                        return found[0][0], found[0][1]
            return None, None

        for ins in comp.instructions:
            if ins.opcode in _SKIP_OPCODES:
                continue
            stage, kind, opk = own[ins.id]
            if stage is None:
                stage, kind = nearest(ins.id)
            out[ins.name] = CompiledOp(stage, kind or opk or "other", ins.metadata.op_type)
    return out


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


_IS_OP: dict[str, bool] = {}  # op type -> whether TensorFlow registers it


def _is_op(op: str) -> bool:
    if op not in _IS_OP:
        from tensorflow.python.framework import op_def_registry

        _IS_OP[op] = op_def_registry.get(op) is not None
    return _IS_OP[op]


class Parsed(NamedTuple):
    """What :func:`parse_space` reads from one XSpace (times in ns, on the shifted axis)."""
    ops: list        # TF op events as dicts (a compiling call's starts after its compile)
    functions: dict  # {step id: function name} of the steps that started a function here
    compiled: list   # HLO op events with their stage and kind (see compiled_ops)
    compiles: list   # {device, thread, name, start, dur}: the compile inside each XLA call


def parse_space(space, device_of, *, shift_ns: int) -> Parsed:
    """Op events of one XSpace as dicts with absolute times (host clock + ``shift_ns``).

    ``device_of(plane_name)`` names the TF device of a plane (None: skip the plane).
    """
    base = start_time_ns(space) or 0
    out, functions, compiled, compiles = [], {}, [], []
    modules = {}  # "module(program id)" -> {instruction: CompiledOp}
    for plane in space.planes:
        if plane.name == "/host:metadata":
            names = {k: v.name for k, v in plane.stat_metadata.items()}
            for md in plane.event_metadata.values():
                for st in md.stats:
                    if names.get(st.metadata_id) == "Hlo Proto" and st.bytes_value:
                        modules[md.name] = module_ops(md.name, st.bytes_value)
    for plane in space.planes:
        device = device_of(plane.name)
        if device is None:
            continue
        meta = plane.event_metadata
        snames = {k: v.name for k, v in plane.stat_metadata.items()}
        wanted = {k: v for k, v in snames.items() if v in ("shape", "from", "to", "key")}
        id_stat = next((k for k, v in snames.items() if v == "id"), None)
        module_stat = next((k for k, v in snames.items() if v == "hlo_module"), None)
        program_stat = next((k for k, v in snames.items() if v == "program_id"), None)
        hlo_names = set().union(*modules.values()) if modules else set()
        module_keys: dict = {}
        # What each event name is, decided once per name: most events of an LLM's trace are the
        # HLO ops of its XLA calls and the thread pool's own; HLO ops are kept only when a live
        # module (metadata plane) names them, and every name not matched here is skipped.
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
                    meta_stats = [s for s in md.stats if s.metadata_id in wanted] \
                        if op in TRANSFER_TYPES else []
                    kinds[mid] = (_OP, node, op, meta_stats)
            elif name in hlo_names:
                kinds[mid] = (_HLO, name)
            elif _COMPILER.search(name):
                kinds[mid] = (_COMPILE,)
        for line in plane.lines:
            t0 = line.timestamp_ns + (base if line.timestamp_ns < _EPOCH_NS else 0) + shift_ns
            thread = line.name or str(line.id)
            execs, ops, calls, compiling = [], [], [], []
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
                elif kind[0] == _COMPILE:
                    compiling.append((start, start + dur))
                elif kind[0] == _HLO:
                    mod = prog = None
                    for st in e.stats:
                        if st.metadata_id == module_stat:
                            mod = snames.get(st.ref_value) if st.ref_value else st.str_value
                        elif st.metadata_id == program_stat:
                            prog = st.int64_value or st.uint64_value
                    key = (mod, prog or 0)
                    key = module_keys.get(key) or module_keys.setdefault(key, f"{mod}({prog or 0})")
                    op = modules.get(key, {}).get(kind[1])
                    if op is not None:
                        compiled.append({"device": device, "thread": thread, "module": key,
                                         "name": kind[1], "start": start, "dur": dur,
                                         "stage": op.stage, "kind": op.kind})
                else:
                    sid = next((_stat_value(s, snames) for s in e.stats
                                if s.metadata_id == id_stat), None)
                    if sid is not None:
                        into = execs if kind[0] == _EXEC else calls
                        into.append((start, start + dur, int(sid)))
            execs.sort()
            starts = [x[0] for x in execs]
            for ev in ops:  # the step of an op: the innermost executor event around it
                i = bisect.bisect_right(starts, ev["start"]) - 1
                while i >= 0 and execs[i][1] < ev["start"] + ev["dur"]:
                    i -= 1
                ev["step"] = execs[i][2] if i >= 0 else None
            for ev in ops if compiling else ():  # a call that compiled: split its time
                s0, s1 = ev["start"], ev["start"] + ev["dur"]
                ends = [c1 for c0, c1 in compiling if s0 <= c0 and c1 <= s1]
                if ends and op_kind(ev["op"]) == "compiled":
                    done = max(ends)
                    compiles.append({"device": device, "thread": thread, "name": ev["name"],
                                     "start": s0, "dur": done - s0})
                    ev["start"], ev["dur"] = done, s1 - done
            out.extend(ops)
            fn_spans = [c for c in calls if isinstance(c[2], str)]
            for s, e, sid in (c for c in calls if isinstance(c[2], int)):
                fname = next((f for fs, fe, f in fn_spans if fs <= s and e <= fe), None)
                if fname:
                    m = _PARTITION.match(fname)
                    functions[sid] = m.group(1) if m else fname
    return Parsed(out, functions, compiled, compiles)


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
        dims = [int(d) if d.strip().lstrip("-").isdigit() else None
                for d in m.group(2).split(",") if d.strip()]
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
