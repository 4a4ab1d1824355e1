"""What each matmul route costs: SmolLM2-135M (Q4_1) decode tokens/s and bytes on one worker,
with tfnb's fused kernel, with the XLA route (compact tensors in plain XLA ops: what a plain
``tf.distribute.Server`` or a GPU runs) and as float32.

Greedy, EOS off, 48 new tokens after a 20-token prompt, batch 1 and 8, one ``tfnb worker`` with
both cores; the XLA route also on a plain ``tf.distribute.Server`` started as TensorFlow's recipe
does. The configurations are timed in alternating rounds (the machine is shared and noisy) and
each figure is the best of its rounds after one call that compiles. ``--scale`` adds a
TinyLlama-1.1B-shaped model of random Q4_0 weights (620 MB; 4.4 GB as float32), whose float32
path reads far more than any cache holds.

Run::

    python benchmarks/bench_routes.py [--scale]  # writes benchmarks/results/routes.{md,json}
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PROMPT = list(range(100, 120))


def held(placed) -> int:
    return sum(int(v.shape.num_elements()) * v.dtype.size for v in placed.variables)


def plain_server():
    """One plain TF server on loopback (guarded: it listens on every interface)."""
    from tfnb.cluster.local import free_ports
    from tfnb.cluster.security import LoopbackGuard

    port = free_ports(1)[0]
    guard = LoopbackGuard([port])
    code = ("import tensorflow as tf; tf.distribute.Server(tf.train.ClusterSpec("
            f"{{'worker': ['127.0.0.1:{port}']}}), job_name='worker', task_index=0).join()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # until it listens
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return f"127.0.0.1:{port}", proc, guard
        time.sleep(0.2)
    proc.kill()
    guard.close()
    raise RuntimeError(f"the plain TF server on port {port} did not listen within 90 s")


def bench(model_path: str | None, label: str, new: int, rounds: int, plain: bool) -> list[dict]:
    import tfnb

    source = "smollm2" if model_path is None else model_path
    packed = tfnb.load_model(source, progress=False)
    floats = tfnb.load_model(source, weights="float32", progress=False)
    configs = []
    cluster = tfnb.local(1)
    device = cluster.devices[0]
    configs.append(("kernel", "tfnb worker", tfnb.place(packed, [device], cluster,
                                                        route="kernel")))
    configs.append(("xla", "tfnb worker", tfnb.place(packed, [device], cluster, route="xla")))
    configs.append(("float32", "tfnb worker", tfnb.place(floats, [device], cluster)))
    for _, _, placed in configs:
        placed.eos_ids = ()
    rows = []
    for B in (1, 8):
        best: dict[str, float] = {}
        calls = {name: (lambda p=placed, B=B: p.generate_ids([PROMPT] * B, max_new_tokens=new))
                 for name, _, placed in configs}
        for call in calls.values():
            call()  # compiles
        for _ in range(rounds):
            for name, call in calls.items():
                t = time.perf_counter()
                call()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
        for name, where, placed in configs:
            rows.append({"model": label, "route": name, "server": where, "batch": B,
                         "tokens_per_s": B * new / best[name], "bytes": held(placed)})
            print(rows[-1], flush=True)
    configs.clear()
    cluster.stop()
    if plain:
        from tfnb.errors import ClusterError

        try:
            address, proc, guard = plain_server()
        except ClusterError as e:  # no loopback guard: a plain server would listen everywhere
            print(f"skipping the plain TF server: {e}", flush=True)
            return rows
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cluster = tfnb.connect([address], timeout=30.0)
            placed = tfnb.place(packed, cluster.devices[:1], cluster)
            assert set(placed.routes.values()) == {"xla"}
            placed.eos_ids = ()
            for B in (1, 8):
                def call(B=B):
                    return placed.generate_ids([PROMPT] * B, max_new_tokens=new)
                call()
                t_best = min(_timed(call) for _ in range(rounds))
                rows.append({"model": label, "route": "xla", "server": "plain TF server",
                             "batch": B, "tokens_per_s": B * new / t_best,
                             "bytes": held(placed)})
                print(rows[-1], flush=True)
            del placed
            cluster.disconnect()
        finally:
            proc.kill()
            proc.wait()
            guard.close()
    return rows


def _timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def table(rows: list[dict]) -> str:
    lines = ["| model | route | server | batch | tokens/s | vs float32 | bytes on the worker |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"] and x["batch"] == r["batch"]
                    and x["route"] == "float32")
        lines.append(f"| {r['model']} | {r['route']} | {r['server']} | {r['batch']} | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                     f"| {r['bytes'] / 1e6:.1f} MB |")
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main() -> None:
    from benchmarks._results import write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scale", action="store_true", help="add a TinyLlama-shaped random model")
    p.add_argument("--no-plain", action="store_true", help="skip the plain TF server")
    a = p.parse_args()
    rows = bench(None, "SmolLM2-135M Q4_1", a.new, a.rounds, not a.no_plain)
    if a.scale:
        import tempfile

        from benchmarks.bench_packed import TINYLLAMA, write_random_gguf

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "tinyllama-shape-q4_0.gguf")
            write_random_gguf(path, TINYLLAMA)
            rows += bench(path, "TinyLlama-1.1B-shaped Q4_0", a.new, max(2, a.rounds // 2),
                          False)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    md = (f"# Matmul routes\n\n{stamp}, {_cpu()}, {os.cpu_count()} cores; "
          f"greedy, {a.new} new tokens after a 20-token prompt, one worker with every core, best "
          f"of {a.rounds} alternating rounds. Command: `python benchmarks/bench_routes.py"
          f"{' --scale' if a.scale else ''}`.\n\n" + table(rows))
    write_results("routes", md, rows)
    print(md)


if __name__ == "__main__":
    main()
