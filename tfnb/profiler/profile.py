"""The :class:`Profile` data object: tables computed from the captured events, several views."""
from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Mapping
from pathlib import Path

from tfnb.errors import ProfileError
from tfnb.names import short_device
from tfnb.profiler import bound as bounds
from tfnb.profiler import export, plots
from tfnb.profiler.build import build
from tfnb.profiler.xplane import op_kind

_MS = 1e6


def union_ns(intervals, lo: int, hi: int) -> int:
    """Total length of the union of ``(start, end)`` intervals clipped to [lo, hi]."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted((max(lo, s), min(hi, e)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0 if cur_e is None else cur_e - cur_s)


def _stage_order(stage: str, order: list | None):
    """Sort key of a stage: its place in ``order`` when given, else embed, blocks, head."""
    if order is not None and stage in order:
        return (order.index(stage), 0)
    if stage == "embed":
        return (-1, 0)
    if stage == "head":
        return (10**9, 0)
    return (int(stage.split(".")[1]) if stage.startswith("block.") else 10**8, 0)


def _function_name(function) -> str:
    if isinstance(function, str):
        return function
    name = getattr(function, "name", None) or getattr(function, "__name__", None)
    if not isinstance(name, str):
        raise ProfileError(f"function={function!r}; expected a tf.function, a Python function "
                           "or a name")
    return name


class Profile:
    """TensorFlow runtime traces of every worker and of this process, on one time axis.

    Made by :func:`tfnb.profiler.profile` and ``%%tfprofile``. All tables are lists of dicts
    (``to_pandas`` turns one into a DataFrame when pandas is installed); times are in ms.

    Attributes
    ----------
    partial : bool
        True when some worker (or this process) could not be traced; ``reasons`` says why.
        The traces come in after the block has ended: the first read of ``partial``,
        ``reasons``, ``spaces`` or any table waits for them (at most the capture's timeout);
        stopping or disconnecting the cluster takes them in first.
    reasons : dict
        ``{worker task or "client": reason}``.
    wall_ms : float
        Length of the profiled block, measured on this process's clock.
    offsets_ms : dict
        Clock offset subtracted from each host's events (0 where clocks agree).

    Examples
    --------
    >>> with tfnb.profiler.profile() as prof:           # doctest: +SKIP
    ...     y = chain(x)
    >>> prof.busy()                                     # doctest: +SKIP
    [{'device': '/job:worker/replica:0/task:0/device:CPU:0', 'compute_ms': 1.2, ...}, ...]
    >>> prof.transfers(chain)                           # doctest: +SKIP
    """

    def __init__(self, data=None):
        self._ready = False
        self._figure_cache: dict = {}
        self._raw, self._pending, self._built = None, None, None
        self.wall_ms, self.window_ns, self.t_begin_ns = 0.0, 0, 0
        if data is not None:
            self._fill(data)

    def _fill(self, raw) -> None:
        """Take a finished capture: its raw dict, or a :class:`~tfnb.profiler.capture.Collection`
        whose traces are still coming in. Nothing waits or parses here, so that leaving the
        profiled block costs only ending the trace window (see capture.py and docs/profiling.md):
        the traces are waited for when ``partial``, ``reasons`` or any table is first read."""
        if isinstance(raw, dict):
            self._raw, t_begin, t_end = raw, raw["t_begin"], raw["t_end"]
        else:
            self._pending, t_begin, t_end = raw, raw.t_begin, raw.t_end
        self.t_begin_ns, self.window_ns = t_begin, t_end - t_begin
        self.wall_ms = self.window_ns / _MS
        self._built = None
        self._ready = True

    def _collected(self) -> dict:
        """The raw capture, waiting for the traces still on their way (bounded by its timeout)."""
        if self._raw is None:
            if self._pending is None:
                return {"spaces": {}, "reasons": {}}
            self._raw, self._pending = self._pending.result(), None
        return self._raw

    @property
    def partial(self) -> bool:
        """True when some worker (or this process) could not be traced; ``reasons`` says why."""
        return bool(self._collected()["reasons"])

    @property
    def reasons(self) -> dict:
        """``{worker task or "client": reason}`` for each host that could not be traced."""
        return dict(self._collected()["reasons"])

    @property
    def spaces(self) -> dict:
        """``{host: serialized XSpace}``: the raw traces, as TensorFlow's profiler wrote them."""
        return {k: v[1] for k, v in self._collected()["spaces"].items()}

    def _check(self) -> None:
        if not self._ready:
            raise ProfileError("the capture is still running; read the profile after the `with` "
                               "block")
        if self._built is None:
            raw = self._collected()
            built = build(raw)
            devs = [f"{w}/device:CPU:0" for w in raw["workers"] if w in raw["spaces"]]
            devs += [e.device for e in built["events"]]
            if "client" in raw["spaces"]:
                devs.append(raw["client_device"])
            built["devices"] = list(dict.fromkeys(devs))
            self._built = built

    @property
    def events(self) -> list:
        """Every traced op (:class:`~tfnb.profiler.xplane.Event`), in time order."""
        self._check()
        return self._built["events"]

    @property
    def functions(self) -> dict:
        """``{step id: function name}``."""
        self._check()
        return self._built["functions"]

    @property
    def devices(self) -> list[str]:
        """Traced devices: workers in cluster order, then this process."""
        self._check()
        return self._built["devices"]

    @property
    def offsets_ms(self) -> dict:
        """Clock offset taken off each host's events (0 where the clocks agree)."""
        self._check()
        return {k: v / _MS for k, v in self._built["offsets_ns"].items()}

    # --- tables ---------------------------------------------------------------------------
    def busy(self) -> list[dict]:
        """Per device: compute, XLA compile, send/receive (incl. waiting for data) and idle time
        in the block.

        ``compute_ms + compile_ms + send_recv_ms + idle_ms == wall_ms``: overlapping ops on
        several threads are counted once (compute first, then compile). A call that compiled
        counts its compile as ``compile_ms`` (see :meth:`compiles`), its run as compute.

        Examples
        --------
        >>> [(r["device"], r["compute_ms"]) for r in prof.busy()]     # doctest: +SKIP
        """
        self._check()
        rows = []
        for dev in self.devices:
            evs = [e for e in self.events if e.device == dev]
            spans = {c: [(e.start, e.start + e.dur) for e in evs if e.category == c]
                     for c in ("compute", "send/receive")}
            spans["compile"] = [(c["start"], c["start"] + c["dur"])
                                for c in self._built["compiles"] if c["device"] == dev]
            compute = union_ns(spans["compute"], 0, self.window_ns)
            working = union_ns(spans["compute"] + spans["compile"], 0, self.window_ns)
            busy = union_ns(spans["compute"] + spans["compile"] + spans["send/receive"], 0,
                            self.window_ns)
            rows.append({"device": dev, "compute_ms": compute / _MS,
                         "compile_ms": (working - compute) / _MS,
                         "send_recv_ms": (busy - working) / _MS,
                         "idle_ms": (self.window_ns - busy) / _MS,
                         "busy_ms": busy / _MS, "wall_ms": self.wall_ms, "ops": len(evs)})
        return rows

    def compile_spans(self) -> list[dict]:
        """Each XLA compile in the block: ``device``, ``name`` (the call's node), ``start`` and
        ``dur`` (ns)."""
        self._check()
        return self._built["compiles"]

    def compiles(self) -> list[dict]:
        """The XLA compiles in the block, one row per device that compiled: ``count`` calls
        that compiled and ``compile_ms`` they spent compiling (before they ran), apart from the
        compute, timeline and transfers of the run itself.

        Examples
        --------
        >>> prof.compiles()                                         # doctest: +SKIP
        [{'device': '/job:worker/replica:0/task:0/device:CPU:0', 'count': 2, 'compile_ms': 612.4}]
        """
        self._check()
        rows: dict = {}
        for c in self.compile_spans():
            r = rows.setdefault(c["device"], {"device": c["device"], "count": 0, "compile_ms": 0.0})
            r["count"] += 1
            r["compile_ms"] += c["dur"] / _MS
        return [rows[d] for d in self.devices if d in rows]

    def steps(self) -> list[dict]:
        """One row per step (one call of a ``tf.function``, on every device it touched).

        Examples
        --------
        >>> prof.steps()[0]["function"]                             # doctest: +SKIP
        '__inference_chain_32'
        """
        self._check()
        spans: dict = {}
        for e in self.events:
            if e.step is not None:
                s = spans.setdefault(e.step, [e.start, e.start + e.dur, set()])
                s[0], s[1] = min(s[0], e.start), max(s[1], e.start + e.dur)
                s[2].add(e.device)
        rows = [{"step": k, "function": self.functions.get(k), "start_ms": s / _MS,
                 "end_ms": t / _MS, "duration_ms": (t - s) / _MS, "devices": sorted(d)}
                for k, (s, t, d) in spans.items()]
        return sorted(rows, key=lambda r: r["start_ms"])

    def calls(self, function) -> list[int]:
        """Step ids of the calls of ``function`` (a ``tf.function``, its Python name or its
        ``__inference_...`` name)."""
        self._check()
        name = _function_name(function)
        pat = re.compile(rf"^__inference_{re.escape(name)}_\d+$")
        return [k for k, f in self.functions.items() if f == name or (f and pat.match(f))]

    def _steps_of(self, function) -> set | None:
        self._check()
        return set(self.calls(function)) if function is not None else None

    def _counted_transfers(self, steps: set | None):
        """Stats of each counted transfer event, within ``steps`` when given."""
        for e in self.events:
            st = e.stats
            if e.category == "send/receive" and st and st.get("counted") \
                    and (steps is None or e.step in steps):
                yield st

    def transfers(self, function=None) -> list[dict]:
        """Bytes and transfer count per source -> destination device.

        With ``function``, only its calls are counted and ``bytes_per_call`` /
        ``count_per_call`` are added. ``unknown`` counts transfers whose size was not traced.
        Only tensors that crossed devices count: not a loop's last, *dead* sends (no data), nor
        hand-offs within one device. :meth:`transfer_edges` breaks the rows down by graph edge.

        Examples
        --------
        >>> prof.transfers(chain)                                  # doctest: +SKIP
        [{'source': '.../task:0/device:CPU:0', 'destination': '.../task:1/device:CPU:0',
          'bytes': 6144, 'count': 3, 'unknown': 0, 'calls': 3, 'bytes_per_call': 2048.0, ...}]
        """
        steps = self._steps_of(function)
        cells: dict = {}
        for st in self._counted_transfers(steps):
            c = cells.setdefault((st["src"], st["dst"]), {"bytes": 0, "count": 0, "unknown": 0})
            c["count"] += 1
            if st.get("bytes") is None:
                c["unknown"] += 1
            else:
                c["bytes"] += st["bytes"]
        rows = [{"source": s, "destination": d, **c} for (s, d), c in sorted(cells.items())]
        if steps is not None:
            for r in rows:
                r.update(calls=len(steps), bytes_per_call=r["bytes"] / max(1, len(steps)),
                         count_per_call=r["count"] / max(1, len(steps)))
        return rows

    def transfer_edges(self, function=None) -> list[dict]:
        """One row per graph edge that crossed devices: the producing node (``tensor``), the
        consuming node, how often it was sent and the bytes, most bytes first.

        An edge inside a ``tf.while_loop`` is sent once per iteration, so a decode loop shows
        its per-token traffic as the edges whose ``count`` is the number of steps; a chain over
        several workers decodes in unrolled chunks, one edge per step of a chunk, each sent once
        per call. ``bytes_each
        is None when the sizes varied or were not traced. Eager copies to this process have no
        node names (``tensor`` and ``consumer`` None).

        Examples
        --------
        >>> [(r["tensor"], r["count"], r["bytes_each"])
        ...  for r in prof.transfer_edges()]                        # doctest: +SKIP
        [('StatefulPartitionedCall', 1, 110592),
         ('while/body/_1/while/StatefulPartitionedCall', 47, 2304), ...]
        """
        cells: dict = {}
        for st in self._counted_transfers(self._steps_of(function)):
            edge = (st["src"], st["dst"], st.get("from"), st.get("to"))
            cells.setdefault(edge, []).append(st.get("bytes"))
        rows = []
        for (src, dst, tensor, consumer), sizes in cells.items():
            known = [b for b in sizes if b is not None]
            rows.append({"source": src, "destination": dst, "tensor": tensor, "consumer": consumer,
                         "count": len(sizes), "bytes": sum(known),
                         "unknown": len(sizes) - len(known),
                         "bytes_each": sizes[0] if len(set(sizes)) == 1 else None})
        return sorted(rows, key=lambda r: (-r["bytes"], r["source"], r["destination"],
                                           str(r["tensor"])))

    def transfer_matrix(self, function=None) -> tuple[list[str], list[list[int]], list[list[int]]]:
        """``(devices, bytes[src][dst], count[src][dst])`` over every device seen."""
        rows = self.transfers(function)
        devs = list(dict.fromkeys(self.devices + [r[k] for r in rows
                                                  for k in ("source", "destination")]))
        nbytes = [[0] * len(devs) for _ in devs]
        count = [[0] * len(devs) for _ in devs]
        for r in rows:
            i, j = devs.index(r["source"]), devs.index(r["destination"])
            nbytes[i][j], count[i][j] = r["bytes"], r["count"]
        return devs, nbytes, count

    def top_ops(self, n: int = 10, by: str = "name") -> list[dict]:
        """The ``n`` ops (``by="name"``: node and device; ``by="op"``: op type; ``by="kind"``:
        matmul, transfer, compiled or other, whatever kernel library TF picked) with the most time.

        Examples
        --------
        >>> prof.top_ops(3, by="op")                                # doctest: +SKIP
        """
        self._check()
        if by not in ("name", "op", "kind"):
            raise ProfileError(f"by={by!r}; expected 'name', 'op' or 'kind'")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ProfileError(f"n={n!r}; expected an integer >= 1")
        agg: dict = {}
        for e in self.events:
            if by == "name":
                key = (e.name, e.op, e.device)
            else:
                key = (op_kind(e.op) if by == "kind" else e.op,)
            a = agg.setdefault(key, [0, 0])
            a[0] += 1
            a[1] += e.dur
        rows = []
        for key, (cnt, tot) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:n]:
            row = dict(zip(("name", "op", "device"), key)) if by == "name" else {by: key[0]}
            row.update(count=cnt, total_ms=tot / _MS, mean_us=tot / cnt / 1e3)
            rows.append(row)
        return rows

    @property
    def compiled(self) -> list[dict]:
        """Every op XLA ran inside the compiled calls, in time order: ``device``, ``module``,
        ``name`` (the HLO instruction), ``start``/``dur`` (ns), ``stage`` (``embed``,
        ``block.i``, ``head``; None for ops outside tfnb's stage scopes) and ``kind`` (one of
        matmul, attention, norm, rope, sampling, copies, other)."""
        self._check()
        return self._built["compiled"]

    def compiled_stages(self) -> bool:
        """Whether any compiled op of a tfnb stage (``embed``, ``block.i``, ``head``) was traced."""
        return any(e["stage"] is not None for e in self.compiled)

    def op_kinds(self) -> list[dict]:
        """Time inside the compiled calls per device and op kind, most first per device:
        ``{"device", "kind", "ms", "share"}`` (``share`` of that device's compiled time).

        Examples
        --------
        >>> [(r["kind"], round(r["share"], 2)) for r in prof.op_kinds()][:2]  # doctest: +SKIP
        [('matmul', 0.81), ('attention', 0.07)]
        """
        cells: dict = {}
        for e in self.compiled:
            cells[(e["device"], e["kind"])] = cells.get((e["device"], e["kind"]), 0) + e["dur"]
        rows = []
        for dev in self.devices:
            total = sum(v for (d, _), v in cells.items() if d == dev)
            mine = sorted(((k, v) for (d, k), v in cells.items() if d == dev),
                          key=lambda kv: -kv[1])
            rows += [{"device": dev, "kind": k, "ms": v / _MS, "share": v / total} for k, v in mine]
        return rows

    def stage_times(self, plan=None, predicted: Mapping | None = None) -> list[dict]:
        """Time per stage and device inside the compiled calls, with its op kinds.

        Every op of tfnb's runtime runs under its stage's name scope, which XLA keeps in the
        compiled ops' metadata, so each compiled op counts to its stage (``embed``, ``block.i``,
        ``head``) and to an op kind. One row per (stage, device) in chain order:

        - ``measured_ms``: its ops' time in the block (summed over threads), prefill and decode;
        - ``prefill_ms``, ``decode_ms`` and ``steps`` (decode steps it ran), ``ms_per_step``;
        - ``kinds``: ``{kind: ms}``, most first, over the block; ``step_kinds``: ``{kind: ms per
          decode step}`` (empty when the stage did not decode);
        - ``predicted_ms``: the planner's seconds per step for the stage (x 1000), from
          ``plan`` (a Plan, or a placed model's; default: the plan of the placed model that
          decoded in the block) or from ``predicted`` (``{stage: ms}``), at the plan's batch
          and context, beside ``ms_per_step``.

        ``plan`` may also be a ``{stage: device}`` mapping over stages of your own: a stage
        with no compiled ops is then timed by the TF ops in its name scope (``stage/...``), else
        by every op on its devices (``basis`` says which).

        Examples
        --------
        >>> rows = prof.stage_times(placed)                         # doctest: +SKIP
        >>> slowest = max(rows, key=lambda r: r["ms_per_step"])     # doctest: +SKIP
        >>> slowest["stage"], next(iter(slowest["kinds"]))          # doctest: +SKIP
        ('block.17', 'matmul')
        """
        self._check()
        if plan is None:  # the plan of the one placed model that decoded here, if it had one
            plans = [pm.plan for pm in bounds.models_in(self) if pm.plan is not None]
            plan = plans[0] if len(plans) == 1 else None
        plan = getattr(plan, "plan", plan)  # a placed model
        assignment = getattr(plan, "assignment", plan)
        if assignment is not None and (not isinstance(assignment, Mapping) or not assignment):
            raise ProfileError(f"plan={plan!r:.80}; expected a Plan, a placed model or a non-empty "
                               "{stage: device} mapping")
        if predicted is None and getattr(plan, "prediction", None) is not None:
            predicted = {k: v * 1e3 for k, v in plan.prediction.stage_s.items()}
        if predicted is not None and not isinstance(predicted, Mapping):
            raise ProfileError(f"predicted={predicted!r:.80}; expected a {{stage: ms}} mapping")
        cells: dict = {}
        for e in self.compiled:
            if e["stage"] is None or (assignment is not None and e["stage"] not in assignment):
                continue
            c = cells.setdefault((e["stage"], e["device"]),
                                 {"kinds": {}, "decode_kinds": {}, "phase": {}, "runs": {}})
            phase = "decode" if "decode" in e["module"] else \
                "prefill" if "prefill" in e["module"] else "other"
            c["phase"][phase] = c["phase"].get(phase, 0) + e["dur"]
            c["kinds"][e["kind"]] = c["kinds"].get(e["kind"], 0) + e["dur"]
            if phase == "decode":
                key = (e["module"], e["name"])
                c["runs"][key] = c["runs"].get(key, 0) + 1
                c["decode_kinds"][e["kind"]] = c["decode_kinds"].get(e["kind"], 0) + e["dur"]
        order = list(assignment) if assignment is not None else None
        rows = []
        for (stage, dev), c in sorted(cells.items(), key=lambda kv: (_stage_order(kv[0][0], order),
                                                                      self.devices.index(kv[0][1]))):
            per_module: dict = {}
            for (module, _), n in c["runs"].items():
                per_module[module] = max(per_module.get(module, 0), n)
            steps, decode = sum(per_module.values()), c["phase"].get("decode", 0)
            row = {"stage": stage, "device": dev, "basis": "compiled ops",
                   "measured_ms": sum(c["phase"].values()) / _MS,
                   "prefill_ms": c["phase"].get("prefill", 0) / _MS,
                   "decode_ms": decode / _MS, "steps": steps,
                   "ms_per_step": decode / steps / _MS if steps else None,
                   "kinds": {k: v / _MS
                             for k, v in sorted(c["kinds"].items(), key=lambda kv: -kv[1])},
                   "step_kinds": {k: v / steps / _MS
                                  for k, v in sorted(c["decode_kinds"].items(),
                                                     key=lambda kv: -kv[1])} if steps else {}}
            if predicted is not None:
                row["predicted_ms"] = predicted.get(stage)
            rows.append(row)
        found = {r["stage"] for r in rows}
        for stage, devs in (assignment or {}).items():
            if stage not in found:
                rows.append(self._scoped_stage(stage, devs, predicted))
        if not rows:
            raise ProfileError("no compiled op of a tfnb stage was traced (nothing ran under the "
                               "runtime's stage scopes); pass {stage: device} to time your own")
        return rows

    def _scoped_stage(self, stage, devs, predicted) -> dict:
        """A stage of the caller's own: its TF ops' time by name scope, else its devices' time."""
        devs = [devs] if isinstance(devs, str) else list(devs)
        full = [d for d in self.devices if any(d == x or d.startswith(x.rstrip("/") + "/") or
                                                 short_device(d) == x for x in devs)]
        if not full:
            raise ProfileError(f"stage {stage!r}: device {devs!r} was not traced; traced: "
                               f"{self.devices}")
        evs = [e for e in self.events if e.device in full and e.category == "compute"]
        scoped = [e for e in evs if e.name == str(stage) or e.name.startswith(f"{stage}/")]
        use = scoped or evs
        measured = sum(union_ns([(e.start, e.start + e.dur) for e in use if e.device == d], 0,
                                self.window_ns) for d in full)
        row = {"stage": stage, "device": full[0], "devices": full,
               "basis": "name scope" if scoped else "device",
               "measured_ms": measured / _MS, "kinds": {}, "step_kinds": {}}
        if predicted is not None:
            row["predicted_ms"] = predicted.get(stage)
        return row

    def bound(self, models=None, *, cluster=None, bandwidth=None, links: bool = True) -> dict:
        """Each device's decode step against its memory-bandwidth bound, and each link's
        traffic (see :mod:`tfnb.profiler.bound`).

        ``{"devices": [...], "links": [...]}``. A device row has ``ms_per_step`` (measured),
        ``bytes_per_step`` (``weights_bytes`` + ``kv_bytes``: what a step reads there),
        ``bandwidth`` (bytes/s), ``bound_ms`` and ``fraction`` (bound / measured; None with a
        ``reason`` when it cannot be told). A link row has ``bytes_per_step`` and ``rtt_ms``.

        ``models``: the placed models to account for (default: those that decoded in the
        block); ``cluster``: where to measure the bandwidth (default: the connected one);
        ``bandwidth``: bytes/s to use instead (a number, or ``{device: bytes/s}``).

        Examples
        --------
        >>> [round(r["fraction"], 2) for r in prof.bound()["devices"]]   # doctest: +SKIP
        [0.71, 0.69]
        """
        self._check()
        if models is None:
            models = bounds.models_in(self)
        else:
            models = list(getattr(models, "replicas", None)
                          or ([models] if hasattr(models, "scheduler") else models))
        return {"devices": bounds.device_rows(self, models, cluster, bandwidth),
                "links": bounds.link_rows(self, models, cluster) if links else []}

    def headline(self) -> list[str]:
        """What the profile says first: the slowest stage and its op kind, and each device's
        fraction of its memory-bandwidth bound (when tfnb's runtime decoded in the block)."""
        if not self.compiled_stages():
            return []
        found = plots.slowest(self.stage_times())
        row, kind, share = found
        per = f"{row['ms_per_step']:.3g} ms/step" if row.get("ms_per_step") \
            else f"{row['measured_ms']:.3g} ms"
        lines = [f"slowest stage: {row['stage']} on {short_device(row['device'])}, {per}"
                 + (f", mostly {kind} ({share:.0%})" if kind else "")]
        if "bound" not in self._figure_cache:
            self._figure_cache["bound"] = self.bound(links=False)["devices"]
        return lines + [bounds.describe(r) for r in self._figure_cache["bound"]]

    def to_pandas(self, table: str = "busy", **kwargs):
        """One table (``busy``, ``steps``, ``transfers``, ``top_ops``) as a pandas DataFrame."""
        try:
            import pandas as pd
        except ImportError:
            raise ProfileError("to_pandas needs pandas, which is not installed; the tables are "
                               "plain lists of dicts") from None
        tables = {"busy": self.busy, "steps": self.steps, "transfers": self.transfers,
                  "top_ops": self.top_ops}
        if table not in tables:
            raise ProfileError(f"table={table!r}; expected one of {', '.join(tables)}")
        return pd.DataFrame(tables[table](**kwargs))

    # --- views ----------------------------------------------------------------------------
    def plot(self, kind: str = "summary", **kwargs):
        """A matplotlib Figure: ``summary``, ``busy``, ``timeline``, ``transfers``, ``top_ops``,
        ``stages`` (``plan=`` and ``predicted=`` as :meth:`stage_times`) or ``bound``
        (``models=``, ``bandwidth=`` as :meth:`bound`). The summary shows the stages when tfnb's
        runtime ran in the block, else the top op types, and each device's fraction of its bound
        beside its busy time.

        Examples
        --------
        >>> fig = prof.plot("timeline")                             # doctest: +SKIP
        """
        self._check()
        return plots.figure(self, kind, **kwargs)

    def save(self, path, kind: str = "summary", **kwargs) -> None:
        """Write a figure to ``path`` (``.png`` or ``.svg``)."""
        suffix = Path(path).suffix.lower()
        if suffix not in (".png", ".svg"):
            raise ProfileError(f"path={str(path)!r}; expected a .png or .svg file name")
        self.plot(kind, **kwargs).savefig(path, format=suffix[1:], bbox_inches="tight")

    def export_tensorboard(self, logdir) -> str:
        """Write the raw traces where TensorBoard's profile plugin reads them; returns the run
        dir."""
        if not self._ready:
            self._check()  # raises: still capturing
        return export.tensorboard(self, logdir)

    def export_chrome_trace(self, path) -> str:
        """Write the merged timeline as Chrome / Perfetto trace JSON; returns the path."""
        self._check()
        return export.chrome_trace(self, path)

    def _summary_png(self) -> str:
        if "png" not in self._figure_cache:
            buf = io.BytesIO()  # memory only: _repr_html_ does no I/O
            self.plot("summary").savefig(buf, format="png", dpi=72, bbox_inches="tight")
            self._figure_cache["png"] = base64.b64encode(buf.getvalue()).decode()
        return self._figure_cache["png"]

    def __repr__(self) -> str:
        if not self._ready:
            return "<tfnb Profile: capturing>"
        state = " PARTIAL" if self.partial else ""
        return f"<tfnb Profile{state}: {self.wall_ms:.1f} ms, {len(self.spaces)} hosts traced>"

    def __str__(self) -> str:
        if not self._ready:
            return repr(self)
        lines = [repr(self)]
        lines += [f"  not traced: {k}: {v}" for k, v in self.reasons.items()]
        lines += [f"  {line}" for line in self.headline()]
        lines += [f"  compiled: {short_device(r['device'])} {r['compile_ms']:.1f} ms in "
                  f"{r['count']} XLA call(s) (not in the compute column)" for r in self.compiles()]
        lines.append(f"  {'device':<22}{'compute':>10}{'send/recv':>11}{'idle':>10}  (ms)")
        lines += [f"  {short_device(r['device']):<22}{r['compute_ms']:>10.2f}"
                  f"{r['send_recv_ms']:>11.2f}{r['idle_ms']:>10.2f}" for r in self.busy()]
        for t in self.transfers():
            unknown = f" ({t['unknown']} of untraced size)" if t["unknown"] else ""
            lines.append(f"  {short_device(t['source'])} -> {short_device(t['destination'])}: "
                         f"{t['bytes']} B in {t['count']} transfers{unknown}")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        if not self._ready:
            return html.escape(repr(self))
        esc = html.escape
        out = [f"<b>{esc(repr(self))}</b>"]
        if self.partial:
            out.append("<ul>" + "".join(f"<li>not traced: {esc(k)}: {esc(v)}</li>"
                                        for k, v in self.reasons.items()) + "</ul>")
        headline = self.headline()
        if headline:
            out.append("<ul>" + "".join(f"<li>{esc(line)}</li>" for line in headline) + "</ul>")
        head = "".join(f"<th>{h}</th>"
                       for h in ("device", "compute ms", "send/recv ms", "idle ms", "ops"))
        body = "".join(f"<tr><td>{esc(short_device(r['device']))}</td>"
                       f"<td>{r['compute_ms']:.2f}</td><td>{r['send_recv_ms']:.2f}</td>"
                       f"<td>{r['idle_ms']:.2f}</td><td>{r['ops']}</td></tr>" for r in self.busy())
        out.append(f"<table><tr>{head}</tr>{body}</table>")
        if self.events:
            out.append(f'<img src="data:image/png;base64,{self._summary_png()}"/>')
        return "\n".join(out)
