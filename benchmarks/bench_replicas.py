"""Concurrent requests on SmolLM2-135M: one worker against replicas on two workers.

Each configuration runs on local workers pinned to one core each (``cpus``), so the replicated
plan has twice the cores of the single worker, as two machines would. ``C`` client threads
(C = 1, 2, 4, 8) each send ``--requests`` greedy requests of ``--new`` new tokens (EOS off, so
every request makes them all); the figure is the aggregate tokens per second of the round and
the median and 95th percentile of the requests' latencies. Configurations:

* ``1 worker``: the model on one worker (requests queue on it);
* ``2 replicas``: ``tfnb.plan(mode="replicate")`` over two workers, each request on the least
  loaded copy.

The machine is shared and noisy: compare the ratios of one run. Writes
``benchmarks/results/replicas.md`` and ``.json``.

Run::

    python benchmarks/bench_replicas.py [--new 48] [--requests 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import warnings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PROMPT = "Name three colours of the rainbow."
CONCURRENCY = (1, 2, 4, 8)


def round_of(placed, prompt, clients: int, requests: int, new: int) -> dict:
    """``clients`` threads, ``requests`` calls each; aggregate tokens/s and latencies."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client():
        for _ in range(requests):
            t0 = time.perf_counter()
            ids = placed.generate_ids(prompt, max_new_tokens=new)
            assert len(ids) == new
            with lock:
                latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return {"clients": clients, "tokens_per_s": clients * requests * new / wall,
            "p50_s": statistics.median(latencies),
            "p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--requests", type=int, default=2)
    args = ap.parse_args()

    import tfnb
    from benchmarks._results import write_results
    from tfnb.cluster.security import ExposedServerWarning

    warnings.simplefilter("ignore", ExposedServerWarning)
    model = tfnb.load_model("smollm2")
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    results = {}
    for name, n_workers in (("1 worker", 1), ("2 replicas", 2)):
        cluster = tfnb.local(n_workers, cpus=[str(i) for i in range(n_workers)])
        try:
            if n_workers == 1:
                placed = tfnb.place(model, cluster.devices, cluster)
            else:
                plan = tfnb.plan(model, cluster, mode="replicate", calibrate=False)
                placed = tfnb.place(model, plan, cluster)
            placed.eos_ids = ()
            for _ in range(2):  # compile (on every replica) outside the rounds
                round_of(placed, prompt, n_workers, 1, args.new)
            results[name] = [round_of(placed, prompt, c, args.requests, args.new)
                             for c in CONCURRENCY]
            print(name, results[name], flush=True)
        finally:
            cluster.stop()

    rows = ["| concurrent requests | 1 worker: tokens/s (p50 / p95 s) | 2 replicas: tokens/s "
            "(p50 / p95 s) | replicas / 1 worker |", "|---|---|---|---|"]
    for one, two in zip(results["1 worker"], results["2 replicas"]):
        rows.append(f"| {one['clients']} | {one['tokens_per_s']:.1f} ({one['p50_s']:.2f} / "
                    f"{one['p95_s']:.2f}) | {two['tokens_per_s']:.1f} ({two['p50_s']:.2f} / "
                    f"{two['p95_s']:.2f}) | {two['tokens_per_s'] / one['tokens_per_s']:.2f}x |")
    md = (f"# Concurrent requests: SmolLM2-135M, greedy, {args.new} new tokens, workers pinned "
          f"to one core each\n\n{time.strftime('%Y-%m-%d %H:%M')}; {args.requests} requests "
          "per client per round.\n\n" + "\n".join(rows) + "\n")
    write_results("replicas", md, {"new": args.new, "requests": args.requests, **results})
    print(md)


if __name__ == "__main__":
    main()
