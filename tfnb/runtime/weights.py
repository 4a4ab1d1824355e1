"""A llama model's weights and KV caches as ``tf.Variable``s on the devices of their segments.

Every value is made a tensor on the client's own CPU before it goes to a device: the copy to a
remote device then runs as an op, which waits for the worker without holding the GIL (a numpy
value converted under a remote device scope holds it; see ``graphs.OnDevice``).

Examples
--------
>>> from tfnb.models.decoder import tiny_config, random_weights
>>> from tfnb.models.chain import Segment
>>> cfg = tiny_config()
>>> seg = Segment("/device:CPU:0", ("embed", "block.0", "block.1", "head"))
>>> p = segment_params(cfg, random_weights(cfg, 0), seg, head_device="/device:CPU:0")
>>> sorted(k for k in p if k != "blocks"), len(p["blocks"])
(['embed_DxV', 'final_norm', 'out_DxV'], 2)
"""

from __future__ import annotations

import re

import numpy as np
import tensorflow as tf

from tfnb.errors import PlacementError
from tfnb.models.chain import Segment, block_stage
from tfnb.models.decoder import weight_shapes
from tfnb.models.packed import PackedStack, PackedTensor
from tfnb.names import short_device
from tfnb.runtime import compact
from tfnb.runtime import forward as L
from tfnb.runtime.graphs import client_cpu

__all__ = ["variable_on", "segment_params", "segment_weights", "kv_caches", "check_weights",
           "param_variables", "packed_routes", "check_route", "ROUTES", "device_type", "host_cpu",
           "compact_weight",
           "with_activations"]


def variable_on(device: str, value, name: str):
    """A non-trainable float32 variable on ``device`` holding ``value`` (numpy or a tensor);
    for a ``PackedTensor``, an ``L.Packed`` over a uint8 variable of its blocks; for a
    ``PackedStack``, an ``L.Stacked`` of those."""
    if isinstance(value, PackedStack):
        return L.Stacked(tuple(variable_on(device, p, f"{name}.{i}")
                               for i, p in enumerate(value.parts)))
    if isinstance(value, PackedTensor):
        with tf.device(client_cpu()):
            data = tf.constant(value.data)
        with tf.device(device):
            var = tf.Variable(data, trainable=False, name=name.replace(".", "_"))
        return L.Packed(var, value.qtype, value.cols)
    with tf.device(client_cpu()):
        value = tf.constant(np.asarray(value, np.float32)) if not isinstance(value, tf.Tensor) \
            else value
    with tf.device(device):
        return tf.Variable(value, trainable=False, name=name.replace(".", "_"))


def segment_params(config, weights, seg: Segment, *, head_device: str, shared: dict | None = None,
                   reuse: dict | None = None, put=None) -> dict:
    """The weight variables of one segment: ``embed_VxD`` or ``embed_DxV``, ``blocks`` (a list
    of ``BlockParams``), ``final_norm`` and ``out_DxV`` as its stages need them.

    The head multiplies by a (D, V) matrix: faster than by the transposed (V, D) table. A tied
    model keeps one (D, V) embedding per device (in ``shared``, device -> variable) on the
    head's device, which the embed stage there reads by columns. ``reuse`` maps
    ``(block index, device)`` to ``BlockParams`` already on that device. ``put(device, value,
    name)`` makes each variable (default :func:`variable_on`; a placement passes its
    ``fileload.WeightLoader.variable``).
    """
    put = put or variable_on
    shared = {} if shared is None else shared
    reuse = reuse or {}
    tied = config.tie_embeddings
    params: dict = {}
    if (seg.has_embed and tied and seg.device == head_device) or (seg.has_head and tied):
        if seg.device not in shared:
            shared[seg.device] = put(seg.device, _head_matrix(weights["embed"]), "embed_T")
        if seg.has_embed:
            params["embed_DxV"] = shared[seg.device]
        if seg.has_head:
            params["out_DxV"] = shared[seg.device]
    elif seg.has_embed:
        params["embed_VxD"] = put(seg.device, weights["embed"], "embed")
    params["blocks"] = [
        reuse.get((i, seg.device)) or L.BlockParams(
            **{k: put(seg.device, v, f"{block_stage(i)}.{k}")
               for k, v in L.fuse_block(weights, i).items()})
        for i in seg.blocks]
    if seg.has_head:
        params["final_norm"] = put(seg.device, weights["final_norm"], "final_norm")
        if not tied:
            params["out_DxV"] = put(seg.device, weights["lm_head"], "lm_head")
    return params


def compact_weight(put, device: str, value, name: str, requantized: list | None = None):
    """``value`` on ``device`` for the XLA route: a packed matrix as a ``compact.Compact`` (its
    blocks made by ``put`` on the device's task CPU, then rewritten there and copied to the
    device), a ``PackedStack`` as a ``Stacked`` of those, anything else as ``put`` makes it. A
    type the route cannot hold exactly is requantized to Q8_0 first; ``requantized`` (a list)
    then gets ``(device, type, bytes added, largest relative error)``."""
    if isinstance(value, PackedStack):
        return L.Stacked(tuple(compact_weight(put, device, p, f"{name}.{i}", requantized)
                               for i, p in enumerate(value.parts)))
    if not isinstance(value, PackedTensor):
        return put(device, value, name)
    if value.qtype not in compact.EXACT:
        kind, nbytes = value.qtype_name, value.nbytes
        value, error = compact.requantized(value)
        if requantized is not None:
            requantized.append((device, kind, value.nbytes - nbytes, error))
    blocks = put(host_cpu(device), value, name)  # a GPU's blocks stay on its task's CPU
    return compact.compact_on(device, blocks.data, value.qtype, value.cols, name)


def with_activations(w, activations: str):
    """``w`` (what :func:`variable_on` makes) with its packed matrices multiplying
    ``activations`` (``"float32"`` or ``"int8"``: ``tfnb.kernels.packed_matmul``)."""
    if isinstance(w, L.Stacked):
        return L.Stacked(tuple(with_activations(p, activations) for p in w.parts))
    return w._replace(activations=activations) if isinstance(w, L.Packed) else w


def segment_weights(config, weights: dict, seg: Segment) -> list:
    """The canonical weights ``seg``'s stages hold (a tied table once), as they are on the
    client.

    Examples
    --------
    >>> from tfnb.models.decoder import tiny_config, random_weights
    >>> cfg = tiny_config()
    >>> len(segment_weights(cfg, random_weights(cfg), Segment("/cpu:0", ("block.0", "head"))))
    11
    """
    names = ["embed"] if seg.has_embed else []
    for i in seg.blocks:
        names += [n for n in weights if n.startswith(f"blocks.{i}.")]
    if seg.has_head:
        names += ["final_norm", "embed" if config.tie_embeddings else "lm_head"]
    return [weights[n] for n in dict.fromkeys(names)]


def _head_matrix(embed):
    """The tied head's (D, V) kernel: the float table transposed, or the packed table itself
    (one row per token is already one row per output channel)."""
    return embed if isinstance(embed, PackedTensor) else embed.T


def kv_caches(seg: Segment, shape) -> list[tuple[tf.Variable, tf.Variable]]:
    """One zeroed ``(k, v)`` cache pair of ``shape`` (B, K, S, E) per block of ``seg``."""
    with tf.device(client_cpu()):
        shape_t, zero = tf.constant(shape, tf.int32), tf.constant(0.0)
    with tf.device(seg.device):
        return [(tf.Variable(tf.fill(shape_t, zero), trainable=False, name=f"k_cache_{i}"),
                 tf.Variable(tf.fill(shape_t, zero), trainable=False, name=f"v_cache_{i}"))
                for i in seg.blocks]


def check_weights(config, weights) -> None:
    """PlacementError naming the first weight that is missing or misshapen."""
    for name, shape in weight_shapes(config).items():
        if name not in weights:
            raise PlacementError(f"weights lack {name!r}: expected every name of "
                                 "weight_shapes(config)")
        if tuple(np.shape(weights[name])) != shape:
            raise PlacementError(f"weight {name!r} has shape {np.shape(weights[name])}: "
                                 f"expected {shape}")


def param_variables(params: list[dict]) -> list[tf.Variable]:
    """Every weight variable of the segments' ``params`` (packed ones: their uint8 variable),
    once each, in stage order."""
    out: dict[int, tf.Variable] = {}
    for p in params:
        for v in [p[k] for k in ("embed_VxD", "embed_DxV") if k in p] \
                + [v for b in p["blocks"] for v in b if v is not None] \
                + [p[k] for k in ("final_norm", "out_DxV") if k in p]:
            for leaf in _leaves(v):
                out.setdefault(id(leaf), leaf)
    return list(out.values())


def _leaves(w) -> list:
    """The variables holding one weight: a packed matrix's blocks, a compact one's values,
    scales and minimums, or the variable itself."""
    if isinstance(w, L.Stacked):
        return [leaf for part in w.parts for leaf in _leaves(part)]
    if isinstance(w, L.Packed):
        return [w.data]
    if isinstance(w, compact.Compact):
        return [t for t in (w.q, w.d, w.m) if t is not None]
    return [w]


ROUTES = ("auto", "kernel", "xla")


_KIND = re.compile(r"(?:/device:|^/)([A-Za-z_]+):\d+$")  # .../device:GPU:0, /gpu:0


def device_type(device: str) -> str:
    """``"GPU"`` for ``.../device:GPU:0`` or ``/gpu:0``; ``"CPU"`` for a CPU or a string naming
    no device type."""
    m = _KIND.search(device)
    return m.group(1).upper() if m else "CPU"


def host_cpu(device: str) -> str:
    """The CPU of ``device``'s task: where a GPU's weights are read and rewritten before they
    are copied to it (TF has CPU kernels for every op of that, not always GPU ones); a CPU
    device itself.

    Examples
    --------
    >>> host_cpu("/job:worker/replica:0/task:1/device:GPU:0")
    '/job:worker/replica:0/task:1/device:CPU:0'
    >>> host_cpu("/device:CPU:1")
    '/device:CPU:1'
    """
    if device_type(device) == "CPU":
        return device
    return f"{device[:_KIND.search(device).start()]}/device:CPU:0"


def check_route(route, devices=None) -> None:
    """PlacementError for a ``route=`` that is not one of :data:`ROUTES` or a dict of worker or
    device -> one of them; with ``devices`` (the cluster's), also for a key naming none of
    them."""
    asked = route.items() if isinstance(route, dict) else [(None, route)]
    for key, r in asked:
        if r is not None and r not in ROUTES:
            where = "" if key is None else f" for {key!r}"
            raise PlacementError(f"route={r!r}{where}: expected one of {list(ROUTES)} (or a dict "
                                 "such as {'worker:1': 'xla'})")
    if isinstance(route, dict) and devices is not None:
        for key in route:
            if not any(_names(key, d) for d in devices):
                known = list(dict.fromkeys(short_device(d).split("/")[0] for d in devices))
                raise PlacementError(f"route key {key!r} names no worker or device of the "
                                     f"cluster: expected one of {known} or a device name")


def _names(key, device: str) -> int:
    """2 when a ``route`` key names ``device`` itself (full or short name), 1 when it names its
    worker (``"worker:1"``, or the task's name), else 0."""
    from tfnb.runtime.fileload import worker_of

    short = short_device(device)
    if str(key) in (device, short):
        return 2
    return int(worker_of(key) == short.split("/")[0])


def _asked_route(route, device: str) -> str:
    """What ``route`` asks for ``device``: a key naming the device itself wins over one naming
    its worker."""
    if not isinstance(route, dict):
        return route or "auto"
    for level in (2, 1):
        for key, r in route.items():
            if _names(key, device) == level:
                return r or "auto"
    return "auto"


def packed_routes(devices, route=None, timeout: float | None = 60.0) -> dict[str, str]:
    """How each device multiplies packed weights: ``"kernel"`` (tfnb's fused ops: a CPU device
    of a ``tfnb worker``) or ``"xla"`` (plain TF ops, :mod:`tfnb.runtime.compact`: any device).

    ``route`` is ``"auto"`` (None: the kernel where a CPU device has tfnb's ops, else XLA),
    ``"kernel"``, ``"xla"``, or a dict of worker or device -> one of those (others auto).
    Each CPU device that may take the kernel runs its op once on a one-value row, under the
    deadline and liveness probes; a device asked for the kernel that lacks it (a plain
    ``tf.distribute.Server``) or is not a CPU is one ``PlacementError``.
    """
    from tfnb import kernels
    from tfnb.runtime.faults import call_with_deadline

    check_route(route)
    asked = {d: _asked_route(route, d) for d in devices}
    for device, r in asked.items():
        if r == "kernel" and device_type(device) != "CPU":
            raise PlacementError(f"route 'kernel' on {short_device(device)}: tfnb's packed-weight "
                                 "kernel is CPU code; use route='xla' (or 'auto') there")
    probing = [d for d, r in asked.items() if r != "xla" and device_type(d) == "CPU"]
    try:
        kernels.library() if probing else None
    except kernels.KernelBuildError as e:
        if any(asked[d] == "kernel" for d in probing):
            raise PlacementError(f"route 'kernel' needs tfnb's ops, which did not build here: "
                                 f"{e}; use route='xla'") from None
        _slower(probing, f"tfnb's ops did not build in this process ({str(e)[:120]})")
        probing = []
    with tf.device(client_cpu()):
        one_row = tf.zeros([1, 4], tf.uint8)

    def probe(device):
        with tf.device(device):
            return kernels.packed_dequantize(one_row, kernels.QTYPES["F32"], 1).numpy()

    routes = dict.fromkeys(devices, "xla")
    fell_back = []
    for device in probing:
        try:
            call_with_deadline(probe, (device,), timeout=timeout, devices=[device],
                               what="checking the packed-weight ops")
            routes[device] = "kernel"
        except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
            if not any(op in str(e) for op in kernels.OP_NAMES):
                raise
            if asked[device] == "kernel":
                raise PlacementError(
                    f"device {device} cannot run tfnb's packed-weight op {kernels.OP_NAMES[1]} "
                    "(its process did not load tfnb's kernels): start that worker with "
                    "`tfnb worker`, or place with route='xla' (or 'auto')") from None
            fell_back.append(device)
    if fell_back:
        _slower(fell_back, "no tfnb ops loaded there (a plain tf.distribute.Server?)")
    return routes


def _slower(devices, why: str) -> None:
    """One warning: CPU ``devices`` that ``route="auto"`` gives the XLA route."""
    import warnings

    names = ", ".join(short_device(d) for d in devices)
    warnings.warn(f"{names}: {why}; packed matrices there take the XLA route, slower than "
                  "tfnb's kernel (docs/gpu.md); place with route='xla' to choose it and silence "
                  "this", UserWarning, stacklevel=6)
