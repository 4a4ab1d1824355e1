"""One TensorFlow worker server: what ``tfnb worker`` and :class:`tfnb.LocalCluster` run.

The process starts ``tf.distribute.Server`` for one task of the cluster, prints one line
``TFNB_READY {json}`` (address, devices, listening scope) and then serves until SIGTERM/SIGINT.
The TF gRPC server also serves TensorFlow's profiler service on the same port;
``--profiler-port`` adds a dedicated profiler server (what ``tf.profiler`` tools expect on
machines where the worker port is not reachable).

With ``--watch-stdin`` the worker exits as soon as its standard input closes: LocalCluster gives
each worker a pipe, and the kernel closes it when the parent dies in any way (even SIGKILL), so no
worker outlives the notebook that started it. A child the parent forked can keep that pipe open
after the parent died, so ``--parent-pid`` also makes the worker exit within a second once it is
no longer that process's child.

Live memory figures go to ``/tmp/tfnb-<uid>/``, a folder only this user may enter (mode 0700,
checked on every start: a folder someone else made, or a symlink, is refused and nothing is
published). The file is removed when the worker stops; LocalCluster removes it after SIGKILL.
"""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import sys
import threading
import time

READY = "TFNB_READY"


def status_dir(uid: int | None = None) -> str:
    """The private folder of ``uid``'s (default: this user's) worker status files."""
    return f"/tmp/tfnb-{os.getuid() if uid is None else int(uid)}"


def status_path(job: str, task: int, port: int, uid: int | None = None) -> str:
    """Where a worker run by ``uid`` publishes its live memory figures (read by ``Cluster.status``).

    Examples
    --------
    >>> status_path("worker", 0, 2222, uid=1000)
    '/tmp/tfnb-1000/worker-worker-0-2222.json'
    """
    return f"{status_dir(uid)}/worker-{job}-{task}-{port}.json"


def private_status_dir() -> str:
    """Make (or check) :func:`status_dir`: a real folder, owned by this user, mode 0700.

    Raises PermissionError naming the folder when it is anything else.
    """
    path = status_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private folder of this user (expected a directory "
                              f"owned by uid {os.getuid()} with mode 0700; found mode "
                              f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}); remove it")
    return path


def _memory_snapshot(tf) -> dict:
    import psutil

    vm = psutil.virtual_memory()
    gpus = []
    for dev in tf.config.list_logical_devices("GPU"):
        try:
            info = tf.config.experimental.get_memory_info(dev.name.split("device:")[-1])
            gpus.append({"device": dev.name, "in_use": int(info["current"]),
                         "peak": int(info["peak"])})
        except (ValueError, RuntimeError):
            pass
    return {"pid": os.getpid(), "host_ram_total": vm.total, "host_ram_available": vm.available,
            "rss": psutil.Process().memory_info().rss, "gpus": gpus, "time": time.time(),
            "cpus": len(os.sched_getaffinity(0))}


def _publish_status(tf, path: str, stop: threading.Event) -> None:
    try:
        private_status_dir()
    except OSError as e:
        print(f"tfnb worker: not publishing memory figures: {e}", file=sys.stderr, flush=True)
        return
    while not stop.is_set():
        with _status_lock:  # serve() removes the file under this lock: no write after that
            if stop.is_set():
                break
            try:
                tmp = f"{path}.{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(_memory_snapshot(tf), f)
                os.replace(tmp, path)
            except OSError:
                pass
        stop.wait(2.0)


_status_lock = threading.Lock()


def parse_cpus(text: str) -> set[int]:
    """CPU numbers from a list like taskset's: ``"0"``, ``"0,2"``, ``"1-3"``; ValueError naming
    the text if it is malformed or names a CPU this process may not run on.

    Examples
    --------
    >>> sorted(parse_cpus("0"))
    [0]
    """
    cpus: set[int] = set()
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if not m:
            cpus = set()
            break
        cpus.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"cpus={text!r}: expected CPU numbers such as '0', '0,2' or '0-3', among "
                         f"the CPUs available here ({_ranges(allowed)})")
    return cpus


def parse_gpus(text) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value of ``tfnb worker --gpu``: GPU indices such as ``"0"``
    or ``"0,1"``, or ``"none"`` (``""``: no GPU, the worker runs on its CPU); ValueError naming
    the text otherwise.

    Examples
    --------
    >>> parse_gpus("1"), parse_gpus(" 0, 2 "), parse_gpus("none")
    ('1', '0,2', '')
    """
    text = str(text).strip()
    if text.lower() == "none":
        return ""
    parts = [p.strip() for p in text.split(",")]
    if not text or not all(re.fullmatch(r"[0-9]+", p) for p in parts):
        raise ValueError(f"gpu={text!r}: expected GPU indices such as '0' or '0,1' (as "
                         "nvidia-smi numbers them), or 'none'")
    return ",".join(str(int(p)) for p in parts)


def _use_gpus(tf, asked: str | None) -> str | None:
    """Let each visible GPU's memory grow as used (so several workers may share one GPU); an
    error line when GPUs were asked for and TensorFlow sees none."""
    gpus = tf.config.list_physical_devices("GPU")
    if asked and not gpus:
        build = tf.sysconfig.get_build_info()
        return (f"--gpu {asked}: this TensorFlow sees no GPU (CUDA build "
                f"{build.get('cuda_version', 'none')}; CUDA_VISIBLE_DEVICES={asked}); install "
                "tensorflow[and-cuda] and check nvidia-smi, or run without --gpu")
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except (ValueError, RuntimeError):  # already initialized: keep TF's default
            pass
    return None


def _ranges(cpus) -> str:
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _watch_stdin(stop: threading.Event) -> None:
    try:
        while sys.stdin.buffer.read(1):
            pass
    except (OSError, ValueError):
        pass
    stop.set()


def _load_packed_ops() -> bool:
    """Load tfnb's packed-weight ops (``tfnb.kernels``) so packed models can run here; without
    a compiler the worker still serves float32 models and says why on stderr."""
    import tensorflow as tf

    from tfnb import kernels

    try:
        kernels.library()
        return True
    except (kernels.KernelBuildError, tf.errors.NotFoundError) as e:  # no compiler; bad .so
        print(f"tfnb worker: packed-weight ops unavailable ({str(e).splitlines()[0]}); "
              "float32 models still run", file=sys.stderr)
        return False


def serve(cluster: str, job: str, task: int, *, profiler_port: int | None = None,
          watch_stdin: bool = False, cpus: str | None = None, parent_pid: int | None = None,
          gpu: str | None = None) -> int:
    """Run one TF server until a signal (or, with ``watch_stdin``, until stdin closes; with
    ``parent_pid``, until this process is no longer that process's child).

    ``cpus`` (e.g. ``"1"`` or ``"0-3"``) pins the worker to those CPUs before TensorFlow starts,
    so TF sizes its thread pools to them: several workers then share one machine without
    competing for cores, or one worker stands in for a slower machine.

    ``gpu`` (``tfnb worker --gpu``: ``"0"``, ``"0,1"`` or ``"none"``) sets the GPUs this
    worker sees (``CUDA_VISIBLE_DEVICES``) before TensorFlow starts, and lets their memory
    grow as used, so one worker per GPU (or several on one) run side by side. Without it the
    worker sees what TensorFlow finds. Packed weights on a GPU take the XLA route
    (``tfnb.runtime.compact``; docs/gpu.md).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if gpu is not None:
        # nvidia-smi's numbering (CUDA's own puts the fastest GPU first)
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        try:
            os.environ["CUDA_VISIBLE_DEVICES"] = parse_gpus(gpu)
        except ValueError as e:
            print(f"tfnb worker: {e}", file=sys.stderr)
            return 2
    if cpus is not None:
        try:
            os.sched_setaffinity(0, parse_cpus(cpus))
        except ValueError as e:
            print(f"tfnb worker: {e}", file=sys.stderr)
            return 2
    from tfnb.cluster.security import listening_scope
    from tfnb.cluster.spec import parse_spec, split_address
    from tfnb.errors import SpecError

    try:
        spec = parse_spec(cluster)
        jobs = spec.as_dict()
        if job not in jobs:
            raise SpecError(f"job {job!r} is not in the cluster; it has {sorted(jobs)}")
        if not 0 <= task < len(jobs[job]):
            raise SpecError(f"task {task} is out of range for job {job!r} ({len(jobs[job])} "
                            f"tasks: 0..{len(jobs[job]) - 1})")
    except SpecError as e:
        print(f"tfnb worker: {e}", file=sys.stderr)
        return 2

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    import tensorflow as tf

    problem = _use_gpus(tf, os.environ["CUDA_VISIBLE_DEVICES"] if gpu is not None else None)
    if problem:
        print(f"tfnb worker: {problem}", file=sys.stderr)
        return 2
    packed_ops = _load_packed_ops()
    address = jobs[job][task]
    _, port = split_address(address)
    try:
        # At least 4 inter-op threads, even on one CPU. Remote ops arrive as unary Enqueue RPCs
        # (see tfnb.cluster.connect), and with one inter-op thread (TF's default on one CPU) two
        # pinned workers deadlock on their first split generate: a unary handler seemingly waits
        # on that pool for work queued on it. Compute still uses the intra-op threads.
        config = tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=max(4, len(os.sched_getaffinity(0))))
        server = tf.distribute.Server(tf.train.ClusterSpec(jobs), job_name=job, task_index=task,
                                      protocol="grpc", config=config, start=True)
    except (tf.errors.OpError, RuntimeError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"tfnb worker: cannot start the TF server on port {port}: {msg}", file=sys.stderr)
        return 1
    if profiler_port:
        tf.profiler.experimental.server.start(profiler_port)
    devices = [d.name for d in tf.config.list_logical_devices()]
    info = {"address": address, "job": job, "task": task, "pid": os.getpid(),
            "target": server.target, "devices": devices,
            "listening": listening_scope(port), "profiler_port": profiler_port or port,
            "cpus": _ranges(os.sched_getaffinity(0)), "packed_ops": packed_ops}
    print(f"{READY} {json.dumps(info)}", flush=True)
    status_file = status_path(job, task, port)
    threading.Thread(target=_publish_status, args=(tf, status_file, stop), daemon=True).start()
    if watch_stdin:
        threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    while not stop.wait(0.5):
        if parent_pid is not None and os.getppid() != parent_pid:
            break  # the parent died: this process was handed to init (or a subreaper)
    stop.set()
    locked = _status_lock.acquire(timeout=2.0)  # bounded: exit even if a write is stuck
    try:
        os.unlink(status_file)
    except OSError:
        pass
    if locked:
        _status_lock.release()
    # TF servers cannot be stopped cleanly from Python (Server.stop is unimplemented for gRPC):
    # leave at once, without running TF's static destructors that may block.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tfnb.cluster.worker")
    p.add_argument("--cluster", required=True)
    p.add_argument("--job", default="worker")
    p.add_argument("--task", type=int, default=0)
    p.add_argument("--profiler-port", type=int, default=None)
    p.add_argument("--watch-stdin", action="store_true")
    p.add_argument("--cpus", default=None)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--gpu", default=None)
    a = p.parse_args(argv)
    return serve(a.cluster, a.job, a.task, profiler_port=a.profiler_port, watch_stdin=a.watch_stdin,
                 cpus=a.cpus, parent_pid=a.parent_pid, gpu=a.gpu)


if __name__ == "__main__":
    sys.exit(main())
