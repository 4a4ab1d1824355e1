"""The cost model: a ``Topology`` of devices and links, and ``predict`` for an assignment.

Per decode step of ``batch`` sequences (one new token each), a stage ``s`` on device ``d`` costs

    t(s, d) = stage_times[(s, d)]                    if measured (seconds per step at this batch)
            = batch * s.flops(context_len) / flops[d]  otherwise (compute bound, no overlap)
            = max(that, step_bytes(s) / memory_bandwidth[d])  when the topology gives the latter

(a decode step at a small batch does two FLOPs per weight it reads, so memory tends to set its
time: how a described cluster predicts speed before any stage was timed), and a hop from
device ``a`` to ``b != a`` carrying ``n`` bytes costs ``latency[a, b] + n / bandwidth[a, b]``.
The activations leaving stage ``k`` cross when stage ``k + 1`` is elsewhere (``batch`` x
``act_bytes_out_per_token``); after the head, the sampled token ids (4 bytes each, sampling runs
next to the head) return to the embedding's device for the next step.

- **latency** (seconds per step, hence per token of one sequence) = every stage time + every hop,
  the return hop included: one token has to go round the whole ring before the next can start.
- **throughput** (tokens/s) = ``batch / max(bottleneck, latency / lanes)``. The bottleneck is
  the busiest resource: a device (the sum of its stages' times) or a directed link (the sum of
  its hops' times, latency included: a link is taken to carry one message at a time). The
  runtime keeps ``lanes`` batches in flight (:mod:`tfnb.runtime.scheduler`: one lane of cache
  rows per device of a split chain, one for a single device), each going round every stage and
  hop once per step, so ``lanes`` batches per ``latency`` bound the rate too. With a single
  batch in flight throughput is ``batch / latency``; once the lanes cover the segments, the
  busiest resource sets it unless the hops lengthen the round (``lane_s`` then exceeds
  ``bottleneck_s``).
  **Serving requests** (``prompt_len`` and ``new_tokens`` given): each of the ``batch``
  sequences is a request that first prefills its prompt (``p(s, d)``: ``prefill_times``
  measured, else compute bound, the head on the last position only) and then makes
  ``new_tokens`` tokens, requests following one another. In the time ``batch`` of them take,
  a resource works ``batch * prefill + new_tokens * step``, so throughput = ``batch *
  new_tokens / max(batch * prefill + new_tokens * step)`` over the resources, the lanes counted
  as one more resource (``latency / lanes`` per step, a prompt's trip through every stage and
  hop ``/ lanes`` per prefill).
  A prompt holds the pipeline: a device runs its work in arrival order, so while one lane's
  prompt occupies device ``k`` for ``p_k``, the other lanes' steps queue there, and every other
  device ``j`` gets at most their ``lanes - 1`` steps of its own (``s_j`` each) and then waits.
  Each prompt therefore costs device ``j`` its own part ``p_j`` plus ``sum over k != j of
  max(0, p_k - (lanes - 1) * s_j)`` waiting (without this term serving rates of a split model
  are overpredicted; docs/placement.md compares both with measured rounds).
- **bytes per token** = bytes crossing devices per step / ``batch``.
- **memory** per device = parameters of its stages + their KV cache for ``batch`` x
  ``context_len`` tokens. Activations and workspace are not counted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from tfnb.errors import PlacementError
from tfnb.names import format_bytes, short_device

__all__ = ["Topology", "Prediction", "predict", "serving_rate", "parse_bytes", "parse_rate",
           "step_bytes", "short_device", "TOKEN_BYTES", "DEFAULT_CONTEXT_LEN"]

TOKEN_BYTES = 4            # one int32 token id per sequence returns from head to embed
DEFAULT_CONTEXT_LEN = 1024  # context assumed when the caller gives none (KV cache and attention)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value) -> float:
    """Bytes from an int, a float or a string such as ``"512MB"`` or ``"2 GiB"``.

    Examples
    --------
    >>> parse_bytes("512MB"), parse_bytes("1 KiB"), parse_bytes(10)
    (512000000, 1024, 10)
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", value.lower())
        if not m:
            raise PlacementError(f"memory {value!r}: expected bytes such as 512000000, '512MB' "
                                 "or '2GiB'")
        return int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
            and value > 0:
        return value if math.isinf(value) else int(value)
    raise PlacementError(f"memory {value!r}: expected a positive number of bytes or a string "
                         "such as '512MB'")


def parse_rate(value, what: str = "memory_bandwidth") -> float:
    """Bytes per second from a number or a string such as ``"50GB/s"`` (or ``"50GB"``).

    >>> parse_rate("50GB/s"), parse_rate("1.25 GB/s"), parse_rate(2e9)
    (50000000000.0, 1250000000.0, 2000000000.0)
    """
    text = value.strip() if isinstance(value, str) else None
    try:
        return float(parse_bytes(text[:-2] if text and text.lower().endswith("/s") else value))
    except PlacementError:
        raise PlacementError(f"{what}={value!r}: expected bytes per second such as 5e10 or "
                             "'50GB/s'") from None


def _per_device(name: str, value, devices: tuple[str, ...], positive=True) -> np.ndarray:
    """A scalar, a sequence (one per device) or a dict device -> value, as a float array."""
    if isinstance(value, dict):
        unknown = [d for d in value if d not in devices]
        missing = [d for d in devices if d not in value]
        if unknown or missing:
            bad = f"unknown device {unknown[0]!r}" if unknown else f"no value for {missing[0]!r}"
            raise PlacementError(f"{name}: {bad}: expected one value per device of {list(devices)}")
        value = [value[d] for d in devices]
    parse = {"memory": parse_bytes, "memory_bandwidth": parse_rate}.get(name)
    if parse is not None:
        value = [parse(v) for v in value] if np.ndim(value) else parse(value)
    arr = np.broadcast_to(np.asarray(value, dtype=float), (len(devices),)).copy() \
        if np.ndim(value) == 0 or len(value) == len(devices) else None
    if arr is None:
        raise PlacementError(f"{name} has {len(value)} values for {len(devices)} devices: "
                             "expected a scalar or one per device")
    if np.isnan(arr).any() or ((arr <= 0).any() if positive else (arr < 0).any()):
        raise PlacementError(f"{name}={value!r}: expected positive numbers")
    return arr


def _times(name: str, times, devices) -> dict:
    """``{(stage, device): seconds}`` checked: known devices, seconds >= 0."""
    out = {}
    for key, seconds in dict(times or {}).items():
        if not (isinstance(key, tuple) and len(key) == 2 and key[1] in devices):
            raise PlacementError(f"{name} key {key!r}: expected (stage, device) with a "
                                 f"device of {list(devices)}")
        if not (isinstance(seconds, (int, float)) and seconds >= 0):
            raise PlacementError(f"{name}[{key!r}]={seconds!r}: expected seconds >= 0")
        out[key] = float(seconds)
    return out


def _matrix(name: str, value, n: int, positive: bool) -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    if arr.ndim == 0:
        arr = np.full((n, n), float(arr))
    if arr.shape != (n, n):
        raise PlacementError(f"{name} has shape {arr.shape}: expected a scalar or ({n}, {n})")
    off = arr[~np.eye(n, dtype=bool)]
    if np.isnan(off).any() or ((off <= 0).any() if positive else (off < 0).any()):
        raise PlacementError(f"{name} has a {'non-positive' if positive else 'negative'} or NaN "
                             "entry off the diagonal: expected "
                             f"{'positive' if positive else 'non-negative'} numbers")
    return arr


class Topology:
    """Devices (plain strings) with memory, speed and the links between them.

    Parameters
    ----------
    devices : sequence of str
    memory : bytes per device (scalar, sequence, dict; ``"512MB"`` strings allowed; inf = unlimited)
    flops : FLOP/s per device (relative speeds work too: only ratios matter to the planners)
    latency : seconds per hop, a scalar or a ``(D, D)`` matrix (``latency[a, b]`` for a -> b)
    bandwidth : bytes/s per hop, a scalar or a ``(D, D)`` matrix
    stage_times : ``{(stage, device): seconds per step}``, measured times that replace the
        FLOP-based estimate (calibration, e.g. from the runtime's per-stage timings)
    prefill_times : ``{(stage, device): seconds per prompt}``, measured prefills likewise
    memory_bandwidth : bytes/s each device reads its memory at (``"50GB/s"`` strings allowed),
        or None (default): a stage not timed then takes at least the time to read what it
        reads (see the module docstring)

    Examples
    --------
    >>> topo = Topology(["a", "b"], memory="1GB", flops=[1e9, 2e9], latency=1e-4, bandwidth=1e9)
    >>> topo
    Topology(2 devices: a, b; 1,000 MB each; 1-2 GFLOP/s)
    >>> topo.link_s(0, 1, 1000)   # 100 us + 1 us
    0.000101
    """

    def __init__(self, devices, memory=math.inf, flops=1e10, latency=1e-4, bandwidth=1e9,
                 stage_times=None, prefill_times=None, memory_bandwidth=None):
        devices = tuple(devices) if not isinstance(devices, str) else (devices,)
        if not devices or not all(isinstance(d, str) and d for d in devices):
            raise PlacementError(f"devices={devices!r}: expected a non-empty list of device "
                                 "strings")
        if len(set(devices)) != len(devices):
            dup = next(d for d in devices if devices.count(d) > 1)
            raise PlacementError(f"device {dup!r} is listed twice: expected distinct devices")
        self.devices = devices
        self.memory = _per_device("memory", memory, devices)
        self.flops = _per_device("flops", flops, devices)
        self.latency = _matrix("latency", latency, len(devices), positive=False)
        self.bandwidth = _matrix("bandwidth", bandwidth, len(devices), positive=True)
        self.stage_times = _times("stage_times", stage_times, devices)
        self.prefill_times = _times("prefill_times", prefill_times, devices)
        self.memory_bandwidth = None if memory_bandwidth is None else _per_device(
            "memory_bandwidth", memory_bandwidth, devices)

    # --- lookups ----------------------------------------------------------------------------
    def index(self, device: str) -> int:
        """Position of ``device``; PlacementError naming the known devices if absent."""
        try:
            return self.devices.index(device)
        except ValueError:
            raise PlacementError(f"unknown device {device!r}: expected one of "
                                 f"{list(self.devices)}") from None

    def link_s(self, a: int, b: int, nbytes: float) -> float:
        """Seconds to move ``nbytes`` from device index ``a`` to ``b`` (0 on the same device)."""
        return 0.0 if a == b else float(self.latency[a, b] + nbytes / self.bandwidth[a, b])

    def stage_s(self, stage, d: int, batch: int = 1, context_len: int = 0) -> float:
        """Seconds one decode step of ``stage`` takes on device index ``d``."""
        measured = self.stage_times.get((stage.name, self.devices[d]))
        if measured is not None:
            return measured
        return max(batch * stage.flops(context_len) / float(self.flops[d]),
                   self.read_s(stage, d, batch, context_len))

    def read_s(self, stage, d: int, batch: int = 1, context_len: int = 0) -> float:
        """Seconds device index ``d`` takes to read what one decode step of ``stage`` reads
        (:func:`step_bytes`) at its ``memory_bandwidth``; 0 when that is not given."""
        if self.memory_bandwidth is None:
            return 0.0
        return step_bytes(stage, batch, context_len) / float(self.memory_bandwidth[d])

    def prefill_s(self, stage, d: int, prompt_len: int) -> float:
        """Seconds the prefill of one prompt of ``prompt_len`` tokens takes in ``stage`` on
        device index ``d`` (measured, else compute bound: the head reads the last position)."""
        measured = self.prefill_times.get((stage.name, self.devices[d]))
        if measured is not None:
            return measured
        tokens = 1 if stage.kind == "head" else prompt_len
        return max(tokens * stage.flops(prompt_len // 2) / float(self.flops[d]),
                   self.read_s(stage, d, 1, prompt_len // 2))

    # --- derived topologies -----------------------------------------------------------------
    def _copy(self, **changes) -> Topology:
        kw = dict(devices=self.devices, memory=self.memory, flops=self.flops,
                  latency=self.latency, bandwidth=self.bandwidth, stage_times=self.stage_times,
                  prefill_times=self.prefill_times, memory_bandwidth=self.memory_bandwidth)
        kw.update(changes)
        return Topology(**kw)

    def subset(self, devices) -> Topology:
        """The topology of ``devices`` alone (in that order): their caps, speeds, links and
        measured times.

        >>> Topology(["a", "b", "c"], flops=[1, 2, 3]).subset(["c", "a"]).flops.tolist()
        [3.0, 1.0]
        """
        idx = [self.index(d) for d in devices]
        keep = set(self.devices[i] for i in idx)
        return Topology([self.devices[i] for i in idx], self.memory[idx], self.flops[idx],
                        self.latency[np.ix_(idx, idx)], self.bandwidth[np.ix_(idx, idx)],
                        {k: t for k, t in self.stage_times.items() if k[1] in keep},
                        {k: t for k, t in self.prefill_times.items() if k[1] in keep},
                        None if self.memory_bandwidth is None else self.memory_bandwidth[idx])

    def with_max_memory(self, max_memory) -> Topology:
        """A copy whose memory caps are replaced by ``max_memory``: a dict device -> bytes, or
        one cap (bytes or a string like ``"400MB"``) for every device.

        Examples
        --------
        >>> Topology(["a", "b"], memory="1GB").with_max_memory({"b": "200MB"}).memory.tolist()
        [1000000000.0, 200000000.0]
        >>> Topology(["a", "b"], memory="1GB").with_max_memory("300MB").memory.tolist()
        [300000000.0, 300000000.0]
        """
        if max_memory is None:
            return self
        if isinstance(max_memory, (str, int, float)) and not isinstance(max_memory, bool):
            max_memory = dict.fromkeys(self.devices, max_memory)
        if not isinstance(max_memory, dict):
            raise PlacementError(f"max_memory={max_memory!r}: expected a dict device -> bytes, "
                                 "or one cap such as '400MB' for every device")
        memory = self.memory.copy()
        for dev, cap in max_memory.items():
            memory[self.index(dev)] = parse_bytes(cap)
        return self._copy(memory=memory)

    def with_stage_times(self, stage_times: dict) -> Topology:
        """A copy with measured ``{(stage, device): seconds}`` added (calibration hook)."""
        return self._copy(stage_times={**self.stage_times, **dict(stage_times)})

    def with_prefill_times(self, prefill_times: dict) -> Topology:
        """A copy with measured ``{(stage, device): seconds per prompt}`` added."""
        return self._copy(prefill_times={**self.prefill_times, **dict(prefill_times)})

    def with_memory_bandwidth(self, memory_bandwidth) -> Topology:
        """A copy whose devices read their memory at ``memory_bandwidth``: one rate for every
        device, one per device, or a dict device -> bytes/s such as
        :func:`tfnb.placement.measure.memory_bandwidth` measures.

        >>> Topology(["a", "b"]).with_memory_bandwidth({"a": 1e10, "b": "20GB/s"}
        ...                                           ).memory_bandwidth.tolist()
        [10000000000.0, 20000000000.0]
        """
        return self._copy(memory_bandwidth=memory_bandwidth)

    def classes(self) -> list[list[int]]:
        """Groups of interchangeable device indices (swapping two leaves every figure unchanged).

        Two devices are interchangeable when they have the same memory, speed and measured
        stage times and swapping them maps the latency and bandwidth matrices onto themselves.
        Such swaps generate a group, so the relation is an equivalence.
        """
        n = len(self.devices)
        times = [tuple(sorted((s, t) for (s, dev), t in self.stage_times.items() if dev == d))
                 for d in self.devices]
        reads = np.zeros(n) if self.memory_bandwidth is None else self.memory_bandwidth
        parent = list(range(n))

        def swappable(a, b):
            if (self.memory[a], self.flops[a], reads[a], times[a]) != \
                    (self.memory[b], self.flops[b], reads[b], times[b]):
                return False
            perm = list(range(n))
            perm[a], perm[b] = b, a
            return all(np.array_equal(m[np.ix_(perm, perm)][~np.eye(n, dtype=bool)],
                                      m[~np.eye(n, dtype=bool)])
                       for m in (self.latency, self.bandwidth))

        for a in range(n):
            for b in range(a + 1, n):
                if parent[b] == b and parent[a] == a and swappable(a, b):
                    parent[b] = a
        groups: dict[int, list[int]] = {}
        for d in range(n):
            groups.setdefault(parent[d], []).append(d)
        return list(groups.values())

    def __repr__(self) -> str:
        names = ", ".join(short_device(d) for d in self.devices[:3])
        more = f", ... ({len(self.devices)} devices)" if len(self.devices) > 3 else ""
        lo, hi = self.memory.min(), self.memory.max()
        mem = (f"{format_bytes(lo, 'MB')} each" if lo == hi else
               f"{format_bytes(lo, 'MB')} to {format_bytes(hi, 'MB')}")
        speed = _span(self.flops / 1e9, "GFLOP/s") if np.isfinite(self.flops).all() else \
            "FLOP/s not limiting"
        if self.memory_bandwidth is not None:
            speed += f"; memory {_span(self.memory_bandwidth / 1e9, 'GB/s')}"
        return f"Topology({len(self.devices)} devices: {names}{more}; {mem}; {speed})"


def _span(values, unit: str) -> str:
    """``"1-2 GFLOP/s"``, or ``"50 GB/s"`` when every value is one."""
    lo, hi = f"{values.min():.3g}", f"{values.max():.3g}"
    return f"{lo} {unit}" if lo == hi else f"{lo}-{hi} {unit}"


@dataclass(frozen=True)
class Prediction:
    """Predicted figures of one assignment (see the module docstring for the model).

    ``latency_s`` seconds per step; ``throughput`` tokens/s (pipelined; with ``prompt_len``
    and ``new_tokens``, of requests served one after another, their prefills included);
    ``decode_throughput`` the decode steps' alone; ``bytes_per_token`` crossing devices;
    ``memory`` and ``capacity`` in bytes per device; ``bottleneck`` names the busiest resource
    and ``bottleneck_s`` its seconds per step; ``stage_s`` each stage's seconds per step on its
    device and ``prefill_s`` per prompt (a replicated plan: on the first replica); ``lanes``
    the batches the runtime keeps in flight and ``lane_s`` = ``latency_s / lanes``, the other
    bound on a step (see :attr:`limit`).
    """

    latency_s: float
    throughput: float
    bytes_per_token: float
    memory: dict = field(default_factory=dict)
    capacity: dict = field(default_factory=dict)
    bottleneck: str = ""
    bottleneck_s: float = 0.0
    stage_s: dict = field(default_factory=dict)
    decode_throughput: float = 0.0
    prompt_len: int = 0
    new_tokens: int = 0
    prefill_s: dict = field(default_factory=dict)
    lanes: int = 1
    lane_s: float = 0.0

    def __post_init__(self):
        if not self.decode_throughput:
            object.__setattr__(self, "decode_throughput", self.throughput)

    def __repr__(self) -> str:
        return (f"Prediction({self.latency_s * 1e3:.3g} ms/token, {self.throughput:.3g} tokens/s, "
                f"{self.bytes_per_token:,.0f} B/token crossing, bottleneck {self.limit})")

    @property
    def limit(self) -> str:
        """What sets the decode rate: the busiest resource (``bottleneck``), or the lanes' trip
        round the devices when that takes longer per lane than the busiest resource's step (the
        busiest resource is named then too: moving a stage changes it, not the round).

        >>> Prediction(4e-3, 500.0, 0.0, bottleneck="compute on a", bottleneck_s=1.8e-3,
        ...            lanes=2, lane_s=2e-3).limit
        '2 lanes, each 4 ms per step round the devices (busiest: compute on a, 1.8 ms per step)'
        """
        if self.lane_s <= self.bottleneck_s:
            return self.bottleneck
        return (f"{self.lanes} lanes, each {self.lane_s * self.lanes * 1e3:.3g} ms per step round "
                f"the devices (busiest: {self.bottleneck}, {self.bottleneck_s * 1e3:.3g} ms per "
                "step)")

    def rate_words(self) -> str:
        """What ``throughput`` counts, in words (after "N tokens/s")."""
        if not self.prompt_len:
            return "pipelined"
        return (f"serving requests of {self.prompt_len} prompt + {self.new_tokens} new tokens "
                f"(decode steps alone {self.decode_throughput:.4g})")

    def over_memory(self) -> dict[str, tuple[float, float]]:
        """``{device: (needed, capacity)}`` for devices whose memory is exceeded."""
        return {d: (m, self.capacity[d]) for d, m in self.memory.items()
                if d in self.capacity and m > self.capacity[d]}


def check_assignment(chain, assignment, devices) -> None:
    """PlacementError unless ``assignment`` maps exactly ``chain``'s stages to known devices."""
    if not isinstance(assignment, dict):
        raise PlacementError(f"assignment={assignment!r:.80}: expected a dict stage -> device")
    unknown = [s for s in assignment if s not in chain]
    if unknown:
        raise PlacementError(f"unknown stage {unknown[0]!r} in the assignment: expected stages of "
                             f"{chain.names[:3]} ... {chain.names[-1]}")
    missing = [s for s in chain.names if s not in assignment]
    if missing:
        raise PlacementError(f"stage {missing[0]!r} has no device ({len(missing)} stages "
                             "missing): the assignment must map every stage")
    bad = [(s, d) for s, d in assignment.items() if d not in devices]
    if bad:
        raise PlacementError(f"stage {bad[0][0]!r} is on unknown device {bad[0][1]!r}: expected "
                             f"one of {list(devices)}")


def check_load(batch, context_len) -> tuple[int, int]:
    """Validated ``(batch, context_len)``; ``None`` context means ``DEFAULT_CONTEXT_LEN``."""
    context_len = DEFAULT_CONTEXT_LEN if context_len is None else context_len
    for name, value, low in (("batch", batch, 1), ("context_len", context_len, 0)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise PlacementError(f"{name}={value!r}: expected an integer >= {low}")
    return int(batch), int(context_len)


def step_bytes(stage, batch: int = 1, context_len: int = 0) -> int:
    """Bytes one decode step of ``stage`` reads from memory: its parameters once (an embedding
    lookup only the ``batch`` rows it looks up) and the keys and values of ``batch`` x
    ``context_len`` cached tokens.

    >>> from tfnb.models import Stage
    >>> step_bytes(Stage("block.0", "block", 1000, 500, 256, 128), batch=2, context_len=10)
    3560
    """
    weights = batch * stage.act_bytes_out_per_token if stage.kind == "embed" \
        else stage.param_bytes
    return int(weights + stage.kv_bytes_per_token * batch * context_len)


def stage_memory(chain, batch: int, context_len: int) -> list[int]:
    """Bytes each stage needs on its device: parameters + KV cache."""
    kv = chain.kv_bytes(batch, context_len)
    return [s.param_bytes + kv[s.name] for s in chain]


def check_requests(prompt_len, new_tokens) -> tuple[int, int]:
    """Validated ``(prompt_len, new_tokens)`` of served requests: both 0 (none) or both >= 1."""
    for name, value in (("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise PlacementError(f"{name}={value!r}: expected a whole number of tokens >= 0")
    if bool(prompt_len) != bool(new_tokens):
        raise PlacementError(f"prompt_len={prompt_len!r}, new_tokens={new_tokens!r}: give both "
                             "(the requests a served model gets) or neither")
    return int(prompt_len), int(new_tokens)


def check_lanes(lanes) -> int:
    """Validated ``lanes`` (batches in flight): an integer >= 1."""
    if isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)) or lanes < 1:
        raise PlacementError(f"lanes={lanes!r}: expected an integer >= 1 (batches in flight)")
    return int(lanes)


def serving_rate(batch: int, new_tokens: int, step: dict, prefill: dict) -> float:
    """Tokens/s of ``batch`` sequences that each prefill a prompt and make ``new_tokens``
    tokens, requests following one another (see the module docstring); ``step`` and
    ``prefill`` give each resource's seconds per decode step and per prompt."""
    cycle = max(batch * prefill.get(k, 0.0) + new_tokens * t for k, t in step.items())
    return batch * new_tokens / cycle if cycle > 0 else math.inf


def predict(chain, assignment: dict, topology: Topology, batch: int = 1,
            context_len: int | None = None, prompt_len: int = 0,
            new_tokens: int = 0, lanes: int | None = None) -> Prediction:
    """Predicted latency, throughput, traffic and memory of ``assignment`` on ``topology``
    (with ``prompt_len`` and ``new_tokens``: the throughput of served requests; ``lanes``: the
    batches in flight, by default the runtime's one per device the chain visits).

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> chain = tiny("llama").chain
    >>> topo = Topology(["a", "b"], flops=1e9, latency=1e-3, bandwidth=1e9)
    >>> p = predict(chain, dict(embed="a", **{"block.0": "a", "block.1": "b", "head": "b"}), topo)
    >>> round(p.latency_s * 1e3, 3)   # compute at context 1024 + a hop there + a token id back
    2.684
    >>> p.bottleneck
    'link a -> b'
    """
    check_assignment(chain, assignment, topology.devices)
    batch, context_len = check_load(batch, context_len)
    prompt_len, new_tokens = check_requests(prompt_len, new_tokens)
    idx = [topology.index(assignment[s.name]) for s in chain]
    lanes = check_lanes(len(set(idx)) if lanes is None else lanes)
    busy: dict[str, float] = {}
    prefill: dict[str, float] = {}  # per resource, seconds per prompt
    stage_s: dict[str, float] = {}
    prefill_s: dict[str, float] = {}
    reading: dict[str, float] = {}  # per device, seconds of stages bound by memory reads
    latency = crossing = 0.0
    for k, stage in enumerate(chain):
        t = stage_s[stage.name] = topology.stage_s(stage, idx[k], batch, context_len)
        latency += t
        key = f"compute on {short_device(topology.devices[idx[k]])}"
        busy[key] = busy.get(key, 0.0) + t
        if (stage.name, topology.devices[idx[k]]) not in topology.stage_times \
                and 0 < t == topology.read_s(stage, idx[k], batch, context_len):
            reading[key] = reading.get(key, 0.0) + t  # memory, not arithmetic, set this time
        if prompt_len:
            p = prefill_s[stage.name] = topology.prefill_s(stage, idx[k], prompt_len)
            prefill[key] = prefill.get(key, 0.0) + p
        nxt, nbytes = (idx[k + 1], batch * stage.act_bytes_out_per_token) if k + 1 < len(idx) \
            else (idx[0], batch * TOKEN_BYTES)
        if nxt != idx[k]:
            t = topology.link_s(idx[k], nxt, nbytes)
            latency += t
            crossing += nbytes
            key = (f"link {short_device(topology.devices[idx[k]])} -> "
                   f"{short_device(topology.devices[nxt])}")
            busy[key] = busy.get(key, 0.0) + t
            if prompt_len:  # a prompt's activations cross once, every position of it
                prefill[key] = prefill.get(key, 0.0) + topology.link_s(
                    idx[k], nxt, stage.act_bytes_out_per_token * prompt_len
                    if k + 1 < len(idx) else TOKEN_BYTES)
    memory = {d: 0 for d in dict.fromkeys(assignment[s] for s in chain.names)}
    for stage, need in zip(chain, stage_memory(chain, batch, context_len)):
        memory[assignment[stage.name]] += need
    capacity = {d: float(topology.memory[topology.index(d)]) for d in memory}
    name, slowest = max(busy.items(), key=lambda kv: kv[1])
    if 2 * reading.get(name, 0.0) > slowest:
        name = name.replace("compute on ", "memory reads on ", 1)
    # the lanes as one more resource: each goes round every stage and hop once per step (a
    # prompt once per prefill), so together they finish `lanes` batches per round
    lane_s, ring = latency / lanes, "lanes"
    decode = batch / max(slowest, lane_s) if max(slowest, lane_s) > 0 else math.inf
    served = decode
    if prompt_len:
        # a prompt holds the pipeline (module docstring): the other devices wait meanwhile
        own = {k: prefill.get(k, 0.0) for k in busy if k.startswith("compute on ")}
        waited = {j: p + sum(max(0.0, q - (lanes - 1) * busy[j]) for k, q in own.items() if k != j)
                  for j, p in own.items()}
        served = serving_rate(batch, new_tokens, {**busy, ring: lane_s},
                              {**prefill, **waited, ring: sum(prefill.values()) / lanes})
    return Prediction(latency, served, crossing / batch, memory, capacity, name, slowest,
                      stage_s, decode, prompt_len, new_tokens, prefill_s, lanes, lane_s)


def predict_replicated(chain, replicas, topology: Topology, batch: int = 1,
                       context_len: int | None = None, prompt_len: int = 0,
                       new_tokens: int = 0) -> Prediction:
    """Figures of a full copy of ``chain`` per entry of ``replicas``, the batch split across
    them. An entry is a device (the whole copy there) or an assignment (stage -> device: the
    copy a pipeline over its devices).

    Each copy gets ``ceil(batch / len(replicas))`` sequences (the last ones fewer) and is
    predicted as :func:`predict` predicts it; latency is the slowest copy's step, throughput
    (and the decode steps' alone) the sum of the copies', memory each device's, and the
    bottleneck the slowest copy's, as are ``lanes`` and ``lane_s`` (each copy's lanes go round
    its own devices only, so its limit is its own). ``stage_s`` and ``prefill_s`` are the first
    copy's.
    """
    batch, context_len = check_load(batch, context_len)
    prompt_len, new_tokens = check_requests(prompt_len, new_tokens)
    copies = [dict.fromkeys(chain.names, r) if isinstance(r, str) else r for r in replicas]
    shares = [batch // len(copies) + (i < batch % len(copies)) for i in range(len(copies))]
    shares = [s for s in shares if s] or [1]
    preds = [predict(chain, a, topology, share, context_len, prompt_len, new_tokens)
             for a, share in zip(copies, shares)]
    memory, capacity = {}, {}
    for p in preds:
        memory.update(p.memory)
        capacity.update(p.capacity)
    for a in copies[len(shares):]:  # copies without a sequence hold their weights only
        for stage in chain:
            d = a[stage.name]
            memory[d] = memory.get(d, 0) + stage.param_bytes
            capacity[d] = float(topology.memory[topology.index(d)])
    slowest = max(preds, key=lambda p: p.latency_s)
    crossing = sum(p.bytes_per_token * s for p, s in zip(preds, shares)) / sum(shares)
    return Prediction(slowest.latency_s, sum(p.throughput for p in preds), crossing, memory,
                      capacity, slowest.bottleneck, slowest.bottleneck_s, preds[0].stage_s,
                      sum(p.decode_throughput for p in preds), prompt_len, new_tokens,
                      preds[0].prefill_s, slowest.lanes, slowest.lane_s)
