"""``Cluster.status()``: per worker, state, latency, devices and memory; text and HTML views.

Gathering is bounded: one GetStatus probe per worker (all at once, under the timeout), then, for
workers that answered and only when this process is connected to them, one small remote read of
the worker's memory figures, also under the timeout. A worker that stops answering between the two
leaves a daemon thread waiting; the call itself returns on time.
"""
from __future__ import annotations

import html
import json
import time
from dataclasses import dataclass, field

from tfnb.cluster.probe import ProbeResult, probe_all
from tfnb.cluster.spec import ClusterSpec, split_address
from tfnb.cluster.worker import status_path
from tfnb.errors import StatusFileError
from tfnb.shutdown import start_thread


@dataclass(frozen=True)
class DeviceStatus:
    name: str
    device_type: str
    memory_total: int | None = None  # bytes
    memory_free: int | None = None


@dataclass(frozen=True)
class WorkerStatus:
    task: str  # /job:worker/replica:0/task:0
    address: str
    state: str  # up | down | unresponsive
    latency_ms: float | None
    devices: tuple[DeviceStatus, ...] = ()
    host_ram_total: int | None = None
    host_ram_free: int | None = None
    error: str = ""
    cpus: int | None = None  # CPUs the worker may run on (tfnb workers report it)


@dataclass(frozen=True)
class ClusterStatus:
    """A snapshot; ``workers`` in task order, ``servers`` maps each server to its listening
    scope."""

    workers: tuple[WorkerStatus, ...]
    servers: dict = field(default_factory=dict)
    took_s: float = 0.0

    @property
    def states(self) -> dict[str, str]:
        return {w.address: w.state for w in self.workers}

    @property
    def all_up(self) -> bool:
        return all(w.state == "up" for w in self.workers)

    def rows(self) -> list[dict]:
        out = []
        for w in self.workers:
            devs = w.devices or (DeviceStatus("-", "-"),)
            for d in devs:
                out.append({"task": w.task, "address": w.address, "state": w.state,
                            "latency_ms": None if w.latency_ms is None else round(w.latency_ms, 2),
                            "device": d.name.rsplit("device:", 1)[-1], "type": d.device_type,
                            "memory": _mem(d.memory_total, d.memory_free), "error": w.error})
        return out

    def __str__(self) -> str:
        cols = ["task", "address", "state", "latency_ms", "device", "memory", "error"]
        rows = [[("" if r[c] is None else str(r[c])) for c in cols] for r in self.rows()]
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
                  for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines += [f"{name}: listens on {scope}" for name, scope in self.servers.items()]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        colour = {"up": "#1a7f37", "down": "#cf222e", "unresponsive": "#bf8700"}
        head = "".join(f"<th>{c}</th>" for c in ("task", "address", "state", "latency", "device",
                                                   "memory free / total (CPU: host RAM)"))
        body = []
        for r in self.rows():
            state = f'<b style="color:{colour.get(r["state"], "#000")}">{r["state"]}</b>'
            if r["error"]:
                state += f' <small>({html.escape(r["error"])})</small>'
            lat = "" if r["latency_ms"] is None else f'{r["latency_ms"]:.1f} ms'
            cells = [r["task"], r["address"], None, lat, f'{r["device"]} ({r["type"]})',
                     r["memory"]]
            body.append("<tr>" + "".join(f"<td>{state if c is None else html.escape(str(c))}</td>"
                                         for c in cells) + "</tr>")
        notes = "".join(f"<li>{html.escape(n)}: listens on <b>{html.escape(s)}</b></li>"
                        for n, s in self.servers.items())
        return (f'<table class="tfnb-status"><thead><tr>{head}</tr></thead>'
                f'<tbody>{"".join(body)}</tbody></table>'
                + (f"<ul>{notes}</ul>" if notes else ""))


def _mem(total: int | None, free: int | None) -> str:
    if total is None:
        return ""
    gib = 1 << 30
    return f"{total / gib:.1f} GiB" if free is None else f"{free / gib:.1f} / {total / gib:.1f} GiB"


def _read_remote(device: str, paths: list[str]):
    """Read the first of ``paths`` that exists, on the worker that owns ``device``.

    A path may be a callable that receives the text read so far (``{path: text}``) and returns
    a path or None: how the status file of a worker run by another user is found.
    """
    import tensorflow as tf

    seen: dict[str, str] = {}
    for path in paths:
        if callable(path):
            path = path(seen)
            if not path:
                continue
        name = tf.constant(path)  # made on this client: nothing converted under a remote scope
        try:
            with tf.device(device):
                text = tf.io.read_file(name)
            seen[path] = text.numpy().decode()
        except tf.errors.NotFoundError:
            continue
        if not path.startswith("/proc/self/"):
            return path, seen[path]
    return None, ""


def _path_of_worker_uid(job: str, task: int, port: int):
    """A path step for :func:`_read_remote`: the status file under the worker's own uid."""
    def pick(seen: dict[str, str]):
        for line in seen.get("/proc/self/status", "").splitlines():
            if line.startswith("Uid:") and line.split()[1:2]:
                return status_path(job, task, port, uid=int(line.split()[1]))
        return None

    return pick


_FIELDS = {"host_ram_total": int, "host_ram_available": int, "cpus": int, "gpus": list}


def parse_status_file(path: str, text: str, task: str) -> dict:
    """The figures of one worker's status file; :class:`StatusFileError` naming the file (and
    what is wrong in it) when it is not what a tfnb worker writes.

    Examples
    --------
    >>> parse_status_file("/tmp/tfnb-0/w.json", '{"cpus": 2}', "/job:worker/replica:0/task:0")
    {'cpus': 2}
    """
    where = f"status file {path} of {task}"
    try:
        data = json.loads(text)
    except ValueError as e:
        raise StatusFileError(f"{where} is not JSON ({e}): {text[:60]!r}; a tfnb worker rewrites "
                              "it every 2 s, so remove it or restart the worker") from None
    if not isinstance(data, dict):
        raise StatusFileError(f"{where} holds {type(data).__name__} {text[:60]!r}; expected a JSON "
                              "object of memory figures")
    for key, kind in _FIELDS.items():
        value = data.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise StatusFileError(f"{where}: {key}={value!r}; expected {kind.__name__}")
    for g in data.get("gpus") or []:
        if not (isinstance(g, dict) and isinstance(g.get("device"), str)
                and isinstance(g.get("in_use"), int) and not isinstance(g.get("in_use"), bool)):
            raise StatusFileError(f"{where}: gpus entry {g!r}; expected "
                                  "{'device': str, 'in_use': bytes, ...}")
    return data


def _memory_all(targets: list[tuple[str, str]], wait: float) -> dict[str, dict]:
    """Memory figures of each (task, address), read on the workers at once; ``{}`` when unknown."""
    boxes: dict[str, dict] = {}
    threads = []
    for task, address in targets:
        job, task_index = task.split("/")[1][4:], int(task.rsplit(":", 1)[1])
        port = split_address(address)[1]
        paths = [status_path(job, task_index, port), "/proc/self/status",
                 _path_of_worker_uid(job, task_index, port), "/proc/meminfo"]
        box = boxes.setdefault(task, {})

        def run(box=box, task=task, paths=paths):
            try:
                box["result"] = _read_remote(f"{task}/device:CPU:0", paths)
            except Exception:  # noqa: BLE001 - the worker went away meanwhile: figures unknown
                pass

        threads.append(start_thread(run, name=f"tfnb-memory {task}"))
    deadline = time.monotonic() + wait
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out = {}
    for task, box in boxes.items():
        which, text = box.get("result", (None, ""))
        if which == "/proc/meminfo":  # in kB
            kb = {ln.split(":")[0]: int(ln.split()[1]) * 1024
                  for ln in text.splitlines() if ln.split()[1:]}
            out[task] = {"host_ram_total": kb.get("MemTotal"),
                         "host_ram_available": kb.get("MemAvailable")}
        elif which:
            out[task] = parse_status_file(which, text, task)
    return out


def gather(spec: ClusterSpec, timeout: float, *, connected: bool, servers: dict | None = None,
           probes: list[ProbeResult] | None = None) -> ClusterStatus:
    """Build a :class:`ClusterStatus`; returns within about ``timeout`` (at least 0.25 s more)."""
    start = time.perf_counter()
    tasks = spec.tasks()
    probes = probes or probe_all([a for _, _, a in tasks], timeout)
    names = [f"/job:{job}/replica:0/task:{i}" for job, i, _ in tasks]
    up = [(n, a) for n, (_, _, a), pr in zip(names, tasks, probes) if pr.state == "up"]
    mems = _memory_all(up, max(0.25, timeout - (time.perf_counter() - start))) if connected else {}
    workers = []
    for task, (_, _, address), pr in zip(names, tasks, probes):
        mem = mems.get(task, {})
        in_use = {g["device"].rsplit("device:", 1)[-1]: g["in_use"] for g in mem.get("gpus", [])}
        devices = []
        for d in pr.devices:
            if d.device_type == "CPU":
                devices.append(DeviceStatus(d.name, "CPU", mem.get("host_ram_total"),
                                            mem.get("host_ram_available")))
            else:
                used = in_use.get(d.short)
                free = None if used is None else max(0, d.memory_limit - used)
                devices.append(DeviceStatus(d.name, d.device_type, d.memory_limit or None, free))
        workers.append(WorkerStatus(task, address, pr.state,
                                    None if pr.latency_s is None else pr.latency_s * 1e3,
                                    tuple(devices), mem.get("host_ram_total"),
                                    mem.get("host_ram_available"), pr.error, mem.get("cpus")))
    return ClusterStatus(tuple(workers), dict(servers or {}), time.perf_counter() - start)
