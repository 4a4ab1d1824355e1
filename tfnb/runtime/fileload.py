"""Weights read by the workers from their own copy of the model's file.

A GGUF model's packed matrices are file-backed on the client (``FileRows``: where their rows
lie). When a worker can see the same file, ``place`` has it read its stages' rows itself, so
the weights never pass through the notebook's process or its link:

- TensorFlow's ``ImmutableConst`` op maps the whole file on the worker (``memory_region_name``
  is a path; an op every TF server has). Each matrix's rows are sliced from it, reordered
  (``Gather``: llama's q/k rows), widened (Q4_0/Q5_0 blocks rewritten as Q8_0 where a fused
  matrix mixes them) and stacked there. A plain slice shares the map's memory, so it is copied
  (``DeepCopy``): a placed weight does not depend on the file afterwards.
- Before anything is placed, each worker's file is compared with the client's: its size
  (``ImmutableConst`` of one byte more than the client's file must fail, and its error names
  the worker's length) and a fingerprint of its header and tensor table (TF's ``Fingerprint``,
  farmhash64, on both sides). A file that differs is one ``PlacementError`` naming the worker,
  the path and the difference.
- A worker without the file (the default path absent there, or ``files={task: None}``) gets
  its weights sent from the client as before, with a progress bar of bytes and MB/s.

Examples
--------
>>> placed = tfnb.place(model, plan, cluster, files={"worker:1": "/data/m.gguf"})  # doctest: +SKIP
>>> placed.weight_sources                                                         # doctest: +SKIP
{'worker:0': 'read /models/m.gguf', 'worker:1': 'read /data/m.gguf'}
"""

from __future__ import annotations

import os
import re

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context, executor

from tfnb.errors import PlacementError
from tfnb.kernels import QTYPES, row_bytes
from tfnb.models.packed import PackedStack, PackedTensor, weight_nbytes
from tfnb.names import short_device

__all__ = ["WeightLoader", "widen_blocks", "file_fingerprint", "check_files"]

_LENGTH = re.compile(r"wrong length \((\d+)\)")
# a worker sent fewer bytes than this gets no progress bar (a tiny or test model)
SHOW_SENDS_FROM = 64 << 20


def _task(device: str) -> str:
    return device.split("/device:")[0]


def _file_parts(value) -> tuple | None:
    return value.parts if isinstance(value, PackedTensor) else None


def widen_blocks(rows, from_qtype: int, qtype: int):
    """uint8 rows of ``from_qtype`` blocks rewritten in ``qtype``, value for value, in TF ops on
    the current device: what ``tfnb.models.packed.widened`` does in numpy (Q4_0 and Q5_0 in
    Q8_0, Q4_1 in Q5_1).

    Examples
    --------
    >>> from tfnb.models.packed import widened
    >>> b = np.random.default_rng(0).integers(0, 256, (2, 18), dtype=np.uint8)
    >>> b[:, 1] = 0x3c                                  # a sane float16 scale
    >>> p = PackedTensor(b, QTYPES["Q4_0"], 32)
    >>> bool(np.array_equal(widen_blocks(tf.constant(b), QTYPES["Q4_0"], QTYPES["Q8_0"]),
    ...                     widened(p, QTYPES["Q8_0"])))
    True
    """
    if from_qtype == qtype:
        return rows
    n_rows = tf.shape(rows)[0]
    blocks = tf.reshape(rows, [n_rows, -1, row_bytes(from_qtype, 32)])
    if from_qtype == QTYPES["Q4_1"]:  # d, m, a zero fifth bit for every value, the nibbles
        zeros = tf.zeros_like(blocks[..., :4])
        return tf.reshape(tf.concat([blocks[..., :4], zeros, blocks[..., 4:]], -1), [n_rows, -1])
    codes = blocks[..., -16:]
    q = tf.cast(tf.concat([tf.bitwise.bitwise_and(codes, 15),
                           tf.bitwise.right_shift(codes, 4)], -1), tf.int16)  # value j, j + 16
    if from_qtype == QTYPES["Q5_0"]:
        qh = tf.cast(blocks[..., 2:6], tf.int32)  # bit j of these 4 bytes: value j's fifth bit
        bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(qh[..., :, None], tf.range(8)), 1)
        high = tf.cast(tf.reshape(bits, tf.shape(q)), tf.int16)
        q = tf.bitwise.bitwise_or(q, tf.bitwise.left_shift(high, 4)) - 16
    else:  # Q4_0
        q = q - 8
    values = tf.bitcast(tf.cast(q, tf.int8), tf.uint8)
    return tf.reshape(tf.concat([blocks[..., :2], values], -1), [n_rows, -1])


def _widen_fn(from_qtype: int, qtype: int):
    """``widen_blocks`` as a traced function (its constants travel inside it; see
    ``WeightLoader._read``), kept with the current cluster's other traces
    (``graphs.shared_entry``: a trace is registered only on the workers of the cluster
    current when it was first called)."""
    from tfnb.runtime.graphs import shared_entry

    return shared_entry(("widen", from_qtype, qtype), lambda: tf.function(
        lambda rows: widen_blocks(rows, from_qtype, qtype), autograph=False,
        input_signature=[tf.TensorSpec([None, None], tf.uint8)]))


def file_fingerprint(header) -> bytes:
    """farmhash64 of a file's first bytes (header and tensor table), as TF's ``Fingerprint``
    computes it on any device."""
    with tf.device("/device:CPU:0"):
        return bytes(tf.raw_ops.Fingerprint(data=tf.constant(header)[None],
                                            method="farmhash64").numpy()[0])


def worker_of(key) -> str:
    """``"worker:1"`` for a ``files=`` key naming a worker by short name, task or device."""
    return short_device(os.fspath(key) if isinstance(key, os.PathLike) else str(key)
                        ).split("/")[0]


def check_files(files, tasks=None) -> None:
    """PlacementError for a ``files=`` argument that is not None, False or a dict of worker ->
    path or None; with ``tasks`` (the cluster's), also for a key naming no worker of them.

    Examples
    --------
    >>> check_files({"worker:7": "/m.gguf"}, ["/job:worker/replica:0/task:0"])
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfnb.errors.PlacementError: files key 'worker:7' names no worker of the cluster: expected ...
    """
    if files is None or files is False:
        return
    if not isinstance(files, dict):
        raise PlacementError(f"files={files!r:.80}: expected None (the model's path on every "
                             "worker), False (send every weight from here) or a dict such as "
                             "{'worker:1': '/data/model.gguf'}")
    for key, path in files.items():
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise PlacementError(f"files[{key!r}]={path!r:.80}: expected a path or None")
        if tasks is not None:
            known = [short_device(t) for t in tasks]
            if worker_of(key) not in known:
                raise PlacementError(f"files key {key!r} names no worker of the cluster: "
                                     f"expected one of {known}")


class WeightLoader:
    """Creates one placement's weight variables: read by the workers that see the model's file,
    sent from the client to the others.

    Parameters
    ----------
    weights : dict
        The model's canonical weights (file-backed ``PackedTensor``s are read where they can
        be).
    devices : list of str
        The placement's devices.
    files : None, False or dict
        ``None``: every worker reads the file at the client's path, or gets the weights sent
        when it has no such file. ``False``: send everything. A dict maps a worker (``"worker:1"``
        or its task or device name) to its own path, or to None (send to it).
    progress : bool or callable
        Progress of the bytes sent to each worker: a bar of each (``True``), or a callable
        ``(done, total, what)`` that may be called from several threads.
    """

    def __init__(self, weights: dict, devices: list[str], files=None, progress=False):
        from tfnb.models.progress import make_reporter

        # one reporter per worker: their weights are made on threads of their own
        self._reporters = {t: make_reporter(progress) for t in
                           dict.fromkeys(_task(d) for d in devices)}
        by_path = {p.path: p for w in weights.values() for p in (_file_parts(w) or ())}
        if len(by_path) > 1:  # one model, one file
            by_path = {}
        self.path = next(iter(by_path), None)
        if self.path is not None:
            first = next(iter(by_path.values()))
            self.size = int(first.buffer.size)
            header_len = min(p.offset for w in weights.values() for p in (_file_parts(w) or ()))
            self.header = np.asarray(first.buffer[:header_len])
        tasks = list(dict.fromkeys(_task(d) for d in devices))
        check_files(files)
        self.paths = {t: self._asked_path(t, files) for t in tasks}  # task -> path or None
        self.sources: dict[str, str] = {}  # task -> the file it read (others were sent)
        self.sent = dict.fromkeys(tasks, 0)
        self._total: dict[str, int] = {}

    def _asked_path(self, task: str, files):
        if self.path is None or files is False:
            return None
        if files is None:
            return self.path
        for key, path in files.items():
            if worker_of(key) == short_device(task):
                return None if path is None else os.path.abspath(os.fspath(path))
        return self.path

    def check(self, timeout: float | None) -> None:
        """Compare each worker's file with the client's, before anything is placed: the first
        that differs (or, when given explicitly, is missing) is one ``PlacementError``; a worker
        without the default path is sent the weights."""
        from tfnb.runtime.faults import call_with_deadline

        if self.path is None:
            return
        want = file_fingerprint(self.header)
        for task, path in self.paths.items():
            if path is None:
                continue
            device = f"{task}/device:CPU:0"
            try:
                length, print_ = call_with_deadline(
                    self._probe, (device, path), timeout=timeout, devices=[device],
                    what=f"checking {path} on {short_device(task)}")
            except tf.errors.OpError as e:  # no such file, a folder, no permission ...
                if path != self.path:
                    raise PlacementError(
                        f"{short_device(task)} cannot read {path!r} "
                        f"({type(e).__name__}): expected the model's file there, or "
                        f"files={{'{short_device(task)}': None}} to send its weights from here"
                    ) from None
                self.paths[task] = None  # not there: sent from here
                continue
            if length != self.size:
                raise PlacementError(
                    f"{short_device(task)}'s {path!r} has {length} bytes where this process's "
                    f"{self.path!r} has {self.size}: expected the same GGUF file (copy it "
                    f"again, or pass files={{'{short_device(task)}': None}} to send its weights "
                    "from here)")
            if print_ != want:
                raise PlacementError(
                    f"{short_device(task)}'s {path!r} has the same size as this process's "
                    f"{self.path!r} but another header or tensor table (fingerprint "
                    f"{print_.hex()} against {want.hex()}): expected the same GGUF file")

    def _probe(self, device: str, path: str) -> tuple[int, bytes]:
        """(the file's length, the fingerprint of its first ``len(header)`` bytes) on
        ``device``; an OpError (NotFoundError ...) when it cannot map the file.

        Its ops run on an executor of their own: the length check fails on purpose, and an op's
        error on the executor the client's threads share fails their calls too (a heal checks
        the file while other copies serve; docs/faults.md, "TensorFlow settings tfnb makes")."""
        own = executor.new_executor(enable_async=False, enable_streaming_enqueue=False)
        try:
            with context.executor_scope(own):
                return self._probe_ops(device, path)
        finally:
            try:
                own.wait()
            except tf.errors.OpError:
                pass
            own.clear_error()

    def _probe_ops(self, device: str, path: str) -> tuple[int, bytes]:
        from tfnb.runtime.graphs import client_cpu
        from tfnb.runtime.weights import host_cpu

        with tf.device(client_cpu()):  # every input made here (see _read)
            begin, one = tf.constant([0], tf.int64), tf.constant([1], tf.int64)
            length = tf.constant([len(self.header)], tf.int64)
            head = tf.constant([1, len(self.header)], tf.int64)
            method = tf.constant("farmhash64")
        with tf.device(host_cpu(device)):  # a GPU's task reads its file on its CPU
            try:  # one byte more than the client's file: fails, naming the worker's length
                whole = tf.raw_ops.ImmutableConst(dtype=tf.uint8, shape=[self.size + 1],
                                                  memory_region_name=path)
                tf.slice(whole, begin, one).numpy()
                return self.size + 1, b""  # at least that long: not the same file
            except tf.errors.InternalError as e:
                m = _LENGTH.search(str(e))
                if m is None:
                    raise
                if int(m.group(1)) != self.size:
                    return int(m.group(1)), b""
            whole = tf.raw_ops.ImmutableConst(dtype=tf.uint8, shape=[self.size],
                                              memory_region_name=path)
            first = tf.reshape(tf.slice(whole, begin, length), head)
            fingerprint = tf.raw_ops.Fingerprint(data=first, method=method)
        return self.size, bytes(fingerprint.numpy()[0])

    def plan_sends(self, segments, weights_of) -> None:
        """Total bytes each task will be sent (for its progress bar): ``weights_of(seg)``
        gives the weights of a segment."""
        for seg in segments:
            task = _task(seg.device)
            if self.paths.get(task) is None:
                total = sum(weight_nbytes(w) for w in weights_of(seg))
                self._total[task] = self._total.get(task, 0) + total

    def variable(self, device: str, value, name: str):
        """``value`` as a variable on ``device`` (``L.Packed`` for a packed weight): read there
        from its file when the worker has it, else sent from here."""
        from tfnb.runtime import forward as L
        from tfnb.runtime.weights import variable_on

        if isinstance(value, PackedStack):
            return L.Stacked(tuple(self.variable(device, p, f"{name}.{i}")
                                   for i, p in enumerate(value.parts)))
        task = _task(device)
        path = self.paths.get(task)
        parts = _file_parts(value)
        if path is not None and parts is not None and all(p.path == self.path for p in parts):
            var = self._read(device, value, path, name)
            self.sources.setdefault(task, f"read {path}")
            return L.Packed(var, value.qtype, value.cols)
        out = variable_on(device, value, name)
        nbytes = weight_nbytes(value)
        self.sent[task] = self.sent.get(task, 0) + nbytes
        total = max(self._total.get(task, 0), self.sent[task])
        if total >= SHOW_SENDS_FROM:
            self._reporters[task](self.sent[task], total, f"sending to {short_device(task)}")
        return out

    def finish(self) -> None:
        """Ends each worker's progress bar at the bytes it was sent."""
        for task, sent in self.sent.items():
            if max(self._total.get(task, 0), sent) >= SHOW_SENDS_FROM and sent:
                self._reporters[task](sent, sent, f"sending to {short_device(task)}")

    def _read(self, device: str, value: PackedTensor, path: str, name: str):
        """``value``'s rows read on ``device`` from its file at ``path``, as a new variable.

        Op by op, every input made on the client first: a Python value made a tensor under a
        remote device scope waits for the worker holding the GIL (``faults``). Not one traced
        function: TF would then treat the file's map as a constant and read a small file once
        for good (probed: a changed file read as before)."""
        from tfnb.runtime.graphs import client_cpu

        with tf.device(client_cpu()):  # small values made here (see weights.variable_on)
            args = [(tf.constant([p.offset], tf.int64),
                     tf.constant([p.span * p.row_bytes], tf.int64),
                     tf.constant([p.span, p.row_bytes], tf.int64),
                     None if p.order is None else tf.constant(p.order, tf.int64))
                    for p in value.parts]
            axis = tf.constant(0, tf.int32)
        with tf.device(device):
            whole = tf.raw_ops.ImmutableConst(dtype=tf.uint8, shape=[self.size],
                                              memory_region_name=path)
            pieces = []
            for p, (begin, length, shape, order) in zip(value.parts, args):
                rows = tf.reshape(tf.slice(whole, begin, length), shape)
                if order is not None:
                    rows = tf.raw_ops.GatherV2(params=rows, indices=order, axis=axis)
                if p.qtype != value.qtype:
                    rows = _widen_fn(p.qtype, value.qtype)(rows)
                pieces.append(rows)
            if len(pieces) > 1:
                data = tf.raw_ops.ConcatV2(values=pieces, axis=axis)
            elif value.parts[0].order is None and value.parts[0].qtype == value.qtype:
                # a plain slice shares the file's map: the variable gets memory of its own
                data = tf.raw_ops.DeepCopy(x=pieces[0])
            else:
                data = pieces[0]
            return tf.Variable(data, trainable=False, name=name.replace(".", "_"))

    def summary(self) -> dict[str, str]:
        """Where each worker's weights came from: ``{"worker:0": "read /m.gguf", "worker:1":
        "sent from the client"}`` (vectors and unpacked weights are always sent)."""
        return {short_device(t): self.sources.get(t, "sent from the client") for t in self.paths}

