"""``Plan``: which device runs each stage, how it was chosen, and what it is predicted to cost.

One data object, several views: ``str(plan)`` (a text table), ``plan._repr_html_()`` (the same
table in a notebook), ``plan.to_python()`` (a snippet that rebuilds it), ``plan.save(path)``
(JSON). A plan is checked against a chain and a topology with :meth:`Plan.validate` before
anything is placed.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tfnb.errors import PlacementError
from tfnb.models.chain import Segment, block_index, block_stage, segments
from tfnb.names import MANUAL, OBJECTIVES, PLAN_MODES, format_bytes, format_span, short_device
from tfnb.placement.cost import (
    DEFAULT_CONTEXT_LEN,
    Prediction,
    Topology,
    check_assignment,
    check_load,
    predict,
    predict_replicated,
)

__all__ = ["Plan", "PlanDiff", "Segment"]

_FORMAT = "tfnb.plan"


@dataclass(frozen=True)
class PlanDiff:
    """Stages that moved between two plans: ``moves`` is ``((stage, from, to), ...)``."""

    moves: tuple[tuple[str, str, str], ...]

    def __len__(self) -> int:
        return len(self.moves)

    def __bool__(self) -> bool:
        return bool(self.moves)

    def __str__(self) -> str:
        if not self.moves:
            return "no stage moved"
        runs: list[list] = []
        for stage, a, b in self.moves:
            if runs and runs[-1][1:] == [a, b]:
                runs[-1][0].append(stage)
            else:
                runs.append([[stage], a, b])
        return "\n".join(f"{format_span(s)}: {short_device(a)} -> {short_device(b)}"
                         for s, a, b in runs)

    def __repr__(self) -> str:
        return f"PlanDiff({len(self)} stages moved)"


def _finite(x):
    return None if isinstance(x, float) and math.isinf(x) else x


def _literal(x) -> str:
    """Python source for plain data (dicts, tuples, floats incl. inf)."""
    if isinstance(x, float) and math.isinf(x):
        return 'float("inf")'
    if isinstance(x, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in x.items()) + "}"
    if isinstance(x, tuple):
        return "(" + "".join(f"{_literal(v)}, " for v in x) + ")"
    return repr(x)


@dataclass(frozen=True)
class Plan:
    """Stage -> device mapping with its mode, objective and predicted figures.

    ``assignment`` maps every stage to a device. A replicated plan (``mode="replicate"``) runs
    one full copy per entry of ``replicas``: a device, or a tuple of devices that holds the copy
    as a pipeline (a hybrid plan), the ``k``-th device of each tuple doing what the ``k``-th
    device of the first does; ``assignment`` is the first copy's. ``prediction`` holds the
    figures of :func:`tfnb.placement.cost.predict` at ``batch`` and ``context_len``.

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> from tfnb.placement import Topology
    >>> chain = tiny("llama").chain
    >>> topo = Topology(["a", "b"], memory="1MB")
    >>> p = Plan.from_assignment(chain, {"embed": "a", "block.0": "a", "block.1": "b",
    ...                                  "head": "b"}, topo, context_len=16)
    >>> p.segments()
    [Segment(a: embed .. block.0 (2)), Segment(b: block.1 .. head (2))]
    """

    assignment: dict
    mode: str = MANUAL
    objective: str = "latency"
    batch: int = 1
    context_len: int = DEFAULT_CONTEXT_LEN
    replicas: tuple = ()
    prediction: Prediction | None = None
    planner_s: float = field(default=0.0, compare=False)

    def __post_init__(self):
        a = self.assignment
        if not isinstance(a, dict) or not a or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in a.items()):
            raise PlacementError(f"assignment={a!r:.80}: expected a non-empty dict stage -> "
                                 "device string")
        if self.mode not in PLAN_MODES:
            raise PlacementError(f"mode={self.mode!r}: expected one of {list(PLAN_MODES)}")
        if self.objective not in OBJECTIVES:
            raise PlacementError(f"objective={self.objective!r}: expected one of "
                                 f"{list(OBJECTIVES)}")
        check_load(self.batch, self.context_len)
        object.__setattr__(self, "replicas", _replica_groups(self.replicas))
        first = self.replicas[:1] and _group(self.replicas[0])
        if first and first != tuple(dict.fromkeys(a.values())):
            raise PlacementError(
                f"replicas={_plain(self.replicas)} but the assignment uses "
                f"{list(dict.fromkeys(a.values()))}: a replicated plan's assignment is its first "
                "copy's, on the first replica's devices in the order its stages reach them")
        if self.prediction is not None and not isinstance(self.prediction, Prediction):
            raise PlacementError(f"prediction={self.prediction!r:.60}: expected a Prediction")

    # --- building and checking --------------------------------------------------------------
    @classmethod
    def from_assignment(cls, chain, assignment: dict, topology: Topology, batch: int = 1,
                        context_len: int | None = None, mode: str = MANUAL,
                        objective: str = "latency", replicas=(), planner_s: float = 0.0,
                        prompt_len: int = 0, new_tokens: int = 0) -> Plan:
        """A validated plan for ``assignment`` with its predicted figures (for requests of
        ``prompt_len`` and ``new_tokens`` tokens when given: :func:`~tfnb.placement.cost.predict`).

        Examples
        --------
        >>> from tfnb.models import tiny
        >>> from tfnb.placement import Topology
        >>> chain = tiny("llama").chain
        >>> Plan.from_assignment(chain, dict.fromkeys(chain.names, "a"), Topology(["a"]))
        Plan(manual, latency: 1 device, 1 segment, ...)
        """
        batch, context_len = check_load(batch, context_len)
        assignment = {s: assignment[s] for s in chain.names} if isinstance(assignment, dict) \
            and set(assignment) == set(chain.names) else assignment
        check_assignment(chain, assignment, topology.devices)
        load = (batch, context_len, prompt_len, new_tokens)
        plan = cls(assignment, mode, objective, batch, context_len, replicas, None, planner_s)
        pred = predict_replicated(chain, plan.replica_assignments(), topology, *load) \
            if plan.replicas else predict(chain, assignment, topology, *load)
        plan = replace(plan, prediction=pred)
        plan._check_memory(pred)
        return plan

    def _check_memory(self, pred: Prediction) -> None:
        over = pred.over_memory()
        if over:
            dev, (need, cap) = next(iter(over.items()))
            raise PlacementError(
                f"device {dev!r} would hold {format_bytes(need, 'MB', 1)} (parameters + KV cache "
                f"at batch {self.batch}, context {self.context_len}) but has "
                f"{format_bytes(cap, 'MB', 1)}: {format_bytes(need - cap, 'MB', 1)} over; move "
                "stages elsewhere or raise max_memory")

    def validate(self, chain, topology) -> Plan:
        """Raise PlacementError if the plan does not fit ``chain`` and ``topology``; else self.

        ``topology`` is a :class:`Topology` (names, memory caps) or a list of device strings
        (names only). Unknown or missing stages, unknown devices and over-full devices are named.

        Examples
        --------
        >>> from tfnb.models import tiny
        >>> chain = tiny("llama").chain
        >>> Plan(dict.fromkeys(chain.names, "a")).validate(chain, ["b"])
        Traceback (most recent call last):
        ...
        tfnb.errors.PlacementError: stage 'embed' is on unknown device 'a': expected one of ['b']
        """
        devices = topology.devices if isinstance(topology, Topology) else list(topology)
        check_assignment(chain, self.assignment, devices)
        for dev in self.devices:
            if dev not in devices:
                raise PlacementError(f"replica device {dev!r} is unknown: expected one of "
                                     f"{devices}")
        if isinstance(topology, Topology):
            self._check_memory(
                predict_replicated(chain, self.replica_assignments(), topology, self.batch,
                                   self.context_len) if self.replicas else
                predict(chain, self.assignment, topology, self.batch, self.context_len))
        return self

    # --- reading ----------------------------------------------------------------------------
    @property
    def devices(self) -> list[str]:
        """Devices in use, in the order the chain first reaches them (replica by replica)."""
        return [d for r in self.replicas for d in _group(r)] or \
            list(dict.fromkeys(self.assignment.values()))

    @property
    def devices_per_replica(self) -> int:
        """Devices each replica's pipeline runs on (1: a full copy per device; 0: no
        replicas)."""
        return len(_group(self.replicas[0])) if self.replicas else 0

    def replica_assignments(self) -> list[dict]:
        """One assignment per replica (the first is ``assignment``); none for a plan that does
        not replicate.

        Examples
        --------
        >>> p = Plan({"embed": "a", "head": "b"}, "replicate", replicas=[("a", "b"), ("c", "d")])
        >>> p.replica_assignments()[1]
        {'embed': 'c', 'head': 'd'}
        """
        if not self.replicas:
            return []
        first = _group(self.replicas[0])
        return [{s: _group(r)[first.index(d)] for s, d in self.assignment.items()}
                for r in self.replicas]

    def segments(self) -> list[Segment]:
        """Runs of consecutive stages on one device, in chain order."""
        return segments(self.assignment)

    def diff(self, other: Plan) -> PlanDiff:
        """Which stages move, from where to where, going from ``self`` to ``other``.

        Examples
        --------
        >>> a = Plan({"embed": "x", "head": "x"}); b = Plan({"embed": "x", "head": "y"})
        >>> print(a.diff(b))
        head: x -> y
        """
        if not isinstance(other, Plan):
            raise PlacementError(f"diff({other!r:.60}): expected a Plan")
        if set(other.assignment) != set(self.assignment):
            odd = sorted(set(other.assignment) ^ set(self.assignment))
            raise PlacementError(f"the plans place different stages ({odd[:3]} in only one): "
                                 "expected plans of the same model")
        return PlanDiff(tuple((s, d, other.assignment[s]) for s, d in self.assignment.items()
                              if other.assignment[s] != d))

    # --- persistence ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain JSON-ready data (``inf`` written as ``null``)."""
        pred = None
        if self.prediction is not None:
            pred = asdict(self.prediction)
            pred["capacity"] = {d: _finite(c) for d, c in pred["capacity"].items()}
            pred["throughput"] = _finite(pred["throughput"])
        return {"format": _FORMAT, "version": 1, "mode": self.mode, "objective": self.objective,
                "batch": self.batch, "context_len": self.context_len,
                "stages": list(self.assignment), "assignment": dict(self.assignment),
                "replicas": _plain(self.replicas), "prediction": pred,
                "planner_s": self.planner_s}

    @classmethod
    def from_dict(cls, data: dict, origin: str = "plan") -> Plan:
        """Inverse of :meth:`to_dict`; PlacementError naming what is wrong."""
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise PlacementError(f"{origin} is not a tfnb plan (no \"format\": \"{_FORMAT}\"): "
                                 "expected a file written by Plan.save")
        for key in ("mode", "objective", "batch", "context_len", "stages", "assignment"):
            if key not in data:
                raise PlacementError(f"{origin} has no {key!r}: expected a file written by "
                                     "Plan.save")
        a, stages = data["assignment"], data["stages"]
        if not isinstance(a, dict) or not isinstance(stages, list) or set(stages) != set(a):
            raise PlacementError(f"{origin}: 'stages' {stages!r:.60} and the assignment's keys "
                                 "differ: expected the same stage names")
        pred = data.get("prediction")
        if pred is not None:
            try:
                pred = dict(pred)
                pred["capacity"] = {d: math.inf if c is None else c
                                    for d, c in pred["capacity"].items()}
                pred["throughput"] = math.inf if pred["throughput"] is None else pred["throughput"]
                pred = Prediction(**pred)
            except (TypeError, KeyError, ValueError, AttributeError) as e:
                raise PlacementError(f"{origin}: bad 'prediction' ({e}): expected the fields of "
                                     "Prediction") from None
        return cls({s: a[s] for s in stages}, data["mode"], data["objective"], data["batch"],
                   data["context_len"], data.get("replicas") or (), pred,
                   float(data.get("planner_s") or 0.0))

    def save(self, path) -> Path:
        """Write the plan as JSON to ``path``; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> Plan:
        """Read a plan written by :meth:`save`; PlacementError if it is missing or corrupt.

        Examples
        --------
        >>> Plan.load(plan.save("plan.json")) == plan   # doctest: +SKIP
        True
        """
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlacementError(f"no plan file at {str(path)!r}: expected a path written by "
                                 "Plan.save") from None
        except IsADirectoryError:
            raise PlacementError(f"plan file {str(path)!r} is a directory: expected a file "
                                 "written by Plan.save") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlacementError(f"plan file {str(path)!r} is not valid JSON ({e}): expected a "
                                 "file written by Plan.save") from None
        return cls.from_dict(data, origin=f"plan file {str(path)!r}")

    def to_python(self) -> str:
        """Python source that rebuilds this plan (``eval``-free: paste it into a cell).

        Examples
        --------
        >>> print(Plan({"embed": "a", "head": "a"}).to_python())   # doctest: +ELLIPSIS
        from tfnb.placement import Plan, Prediction
        plan = Plan(
            assignment={
                **dict.fromkeys(["embed", "head"], "a"),
            },
        ...
        """
        lines = ["from tfnb.placement import Plan, Prediction", "plan = Plan(", "    assignment={"]
        for seg in self.segments():
            names, dev = _names_source(seg.stages), json.dumps(seg.device)
            lines.append(f"        **dict.fromkeys({names}, {dev}),")
        lines += ["    },", f"    mode={self.mode!r}, objective={self.objective!r}, "
                  f"batch={self.batch}, context_len={self.context_len},"]
        if self.replicas:
            lines.append(f"    replicas={_literal(self.replicas)},")
        if self.prediction is not None:
            p = self.prediction
            lines.append("    prediction=Prediction(" + ", ".join(
                f"{k}={_literal(v)}" for k, v in asdict(p).items()) + "),")
        lines.append(")")
        return "\n".join(lines)

    # --- views ------------------------------------------------------------------------------
    def _rows(self) -> list[tuple[str, ...]]:
        pred = self.prediction
        rows = []
        segs = [(f" (replica {i})", seg) for i, a in enumerate(self.replica_assignments())
                for seg in segments(a)] or [("", seg) for seg in self.segments()]
        for copy, seg in segs:
            mem = ""
            if pred is not None and seg.device in pred.memory:
                cap = pred.capacity.get(seg.device, math.inf)
                mem = f"{pred.memory[seg.device] / 1e6:,.1f} / " + (
                    "inf" if math.isinf(cap) else f"{cap / 1e6:,.0f} MB")
            rows.append((short_device(seg.device) + copy, format_span(seg.stages), mem))
        return rows

    def _summary(self) -> str:
        head = (f"{self.mode} plan (objective {self.objective}), batch {self.batch}, context "
                f"{self.context_len}: {len(self.devices)} device(s)"
                + (f", {len(self.replicas)} replicas" if self.replicas else
                   f", {len(self.segments())} segment(s)")
                + (f" of {len(self.segments())} segments each" if self.devices_per_replica > 1
                   else ""))
        p = self.prediction
        if p is None:
            return head
        return head + (f"\npredicted: {p.latency_s * 1e3:.4g} ms/token latency, "
                       f"{p.throughput:.4g} tokens/s {p.rate_words()}, "
                       f"{p.bytes_per_token:,.0f} B/token "
                       f"crossing devices; bottleneck: {p.limit}")

    _HEADER = ("device", "stages", "device memory used / cap (MB)")

    def __str__(self) -> str:
        rows = [self._HEADER] + self._rows()
        widths = [max(len(r[c]) for r in rows) for c in range(3)]
        table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([self._summary().split("\n")[0]] + table
                         + self._summary().split("\n")[1:])

    def __repr__(self) -> str:
        n = len(self.devices)
        return (f"Plan({self.mode}, {self.objective}: {n} device{'s' * (n != 1)}, "
                f"{len(self.segments())} segment{'s' * (len(self.segments()) != 1)}, "
                + (f"{self.prediction.latency_s * 1e3:.3g} ms/token)" if self.prediction
                   else "not predicted)"))

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self._HEADER)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                       for r in self._rows())
        summary = "<br>".join(html.escape(s) for s in self._summary().split("\n"))
        return (f'<div class="tfnb-plan"><p>{summary}</p><table><thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table></div>")


def _group(replica) -> tuple[str, ...]:
    """A replica's devices (one entry of ``Plan.replicas``)."""
    return (replica,) if isinstance(replica, str) else replica


def _plain(replicas) -> list:
    """``Plan.replicas`` as JSON-ready lists."""
    return [r if isinstance(r, str) else list(r) for r in replicas]


def _replica_groups(replicas) -> tuple:
    """``replicas`` checked and normalised: a tuple whose entries are device strings, or
    tuples of two or more, all of one length, no device twice."""
    bad = f"replicas={replicas!r:.120}: expected a list of devices (a full copy on each) or " \
          "of equal-length device lists (a pipeline per copy)"
    if isinstance(replicas, str) or not isinstance(replicas, (list, tuple)):
        raise PlacementError(bad)
    out = []
    for r in replicas:
        group = (r,) if isinstance(r, str) else r
        if not isinstance(group, (list, tuple)) or not group or \
                not all(isinstance(d, str) and d for d in group):
            raise PlacementError(bad)
        out.append(group[0] if len(group) == 1 else tuple(group))
    if len({len(_group(r)) for r in out}) > 1:
        raise PlacementError(bad)
    seen = [d for r in out for d in _group(r)]
    twice = next((d for d in seen if seen.count(d) > 1), None)
    if twice is not None:
        raise PlacementError(f"device {twice!r} is in two replicas: each copy needs its own "
                             "devices")
    return tuple(out)


def _names_source(stages) -> str:
    """``["embed", *(f"block.{i}" for i in range(0, 9))]`` for runs of numbered blocks."""
    parts, i = [], 0
    while i < len(stages):
        a, j = block_index(stages[i]), i
        while a is not None and j + 1 < len(stages) and stages[j + 1] == block_stage(a + j + 1 - i):
            j += 1
        if a is not None and j - i >= 2:
            parts.append(f'*(f"block.{{i}}" for i in range({a}, {a + j - i + 1}))')
        else:
            parts += [json.dumps(s) for s in stages[i:j + 1]]
        i = j + 1
    return "[" + ", ".join(parts) + "]"
