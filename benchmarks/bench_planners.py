"""Placement planners compared on synthetic heterogeneous clusters (cost model only, no TF).

For each cluster and planner: the predicted bottleneck, per-token latency, pipelined throughput,
bytes crossing devices per token and the planner's own time. Then the planner time of
``optimal`` on 200 stages x 16 devices. Writes ``benchmarks/results/planners.md`` and ``.json``.

Run::

    python benchmarks/bench_planners.py
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tfnb.errors import PlacementError
from tfnb.models import LayerChain, Stage
from tfnb.placement import Topology, plan

from _results import write_results

MB = 10**6
BATCH, CONTEXT = 8, 1024


def smollm2_chain() -> LayerChain:
    """SmolLM2-135M's stages (embed, 30 blocks, tied head), as ``load_model`` reports them."""
    blocks = [Stage(f"block.{i}", "block", 14_155_776, 7_077_888, 2304, 1536,
                    attn_flops_per_context=2304) for i in range(30)]
    return LayerChain([Stage("embed", "embed", 113_246_208, 0, 2304, 0), *blocks,
                       Stage("head", "head", 113_248_512, 56_623_104, 196_608, 0)])


def long_chain(n: int = 200) -> LayerChain:
    """``n`` stages of a 7B-like model cut finer: 100 MB and 0.2 GFLOP per block."""
    blocks = [Stage(f"block.{i}", "block", 100 * MB, 2 * 10**8, 16384, 4096,
                    attn_flops_per_context=16384) for i in range(n - 2)]
    return LayerChain([Stage("embed", "embed", 500 * MB, 0, 16384, 0), *blocks,
                       Stage("head", "head", 500 * MB, 10**9, 4 * 32000, 0)])


def hosts(n_hosts, per_host, speeds, fast=(2e-5, 2e10), slow=(5e-4, 1.25e9)):
    """Devices on hosts: links inside a host ``fast`` (latency s, B/s), between hosts ``slow``."""
    host = np.repeat(np.arange(n_hosts), per_host)
    same = host[:, None] == host[None, :]
    names = [f"/job:worker/replica:0/task:{h}/device:GPU:{i % per_host}"
             for i, h in enumerate(host)]
    return names, np.where(same, fast[0], slow[0]), np.where(same, fast[1], slow[1]), speeds


def clusters(chain):
    need = chain.total_param_bytes + sum(chain.kv_bytes(BATCH, CONTEXT).values())
    rng = np.random.default_rng(0)
    out = {}
    names, lat, bw, _ = hosts(4, 4, None)
    out["16 dev: 4 hosts x 4, 1x-4x by host, 2.5x the memory needed"] = Topology(
        names, memory=need / 16 * 2.5, flops=np.repeat([1e11, 2e11, 3e11, 4e11], 4),
        latency=lat, bandwidth=bw)
    names, lat, bw, _ = hosts(2, 4, None)
    out["8 dev: 2 hosts x (1x, 4x), slow links, tight memory"] = Topology(
        names, memory=need / 8 * 1.5, flops=np.tile([1e11, 1e11, 4e11, 4e11], 2),
        latency=lat * 4, bandwidth=bw / 4)
    names, lat, bw, _ = hosts(1, 4, None)
    out["4 dev: one host, 1x 2x 3x 4x, fast links, ample memory"] = Topology(
        names, memory=need * 1.5, flops=[1e11, 2e11, 3e11, 4e11], latency=lat, bandwidth=bw)
    names, lat, bw, _ = hosts(3, 2, None)
    out["6 dev: 3 hosts, random 1x-4x, 5 ms / 100 MB/s between hosts"] = Topology(
        names, memory=need / 6 * 1.4, flops=rng.uniform(1e11, 4e11, 6),
        latency=np.where(lat > 1e-4, 5e-3, lat), bandwidth=np.where(bw < 1e10, 1e8, bw))
    return out


PLANNERS = [("replicate", "latency"), ("memory", "latency"), ("greedy", "latency"),
            ("optimal", "latency"), ("optimal", "throughput")]


def row(chain, topo, mode, objective):
    start = time.perf_counter()
    try:
        p = plan(chain, topo, mode=mode, objective=objective, batch=BATCH, context_len=CONTEXT)
    except PlacementError as e:
        return {"planner": f"{mode}/{objective}" if mode == "optimal" else mode,
                "error": str(e)[:90]}
    took = time.perf_counter() - start
    pr = p.prediction
    return {"planner": f"{mode}/{objective}" if mode == "optimal" else mode,
            "devices": len(p.devices), "segments": len(p.segments()),
            "bottleneck": pr.limit, "latency_ms": pr.latency_s * 1e3,
            "tokens_per_s": pr.throughput, "bytes_per_token": pr.bytes_per_token,
            "planner_ms": took * 1e3}


def markdown(results) -> str:
    lines = [f"# Placement planners (predicted by the cost model; batch {BATCH}, context "
             f"{CONTEXT})", "",
             "Latency: seconds per decode step (one token per sequence). Throughput: "
             "pipelined steady state, batch / the longer of the slowest resource's step and "
             "a lane's round of the devices / lanes (one lane of requests per device; see "
             "tfnb.placement.cost).", ""]
    for name, rows in results["clusters"].items():
        lines += [f"## {name}", "", "| planner | devices | bottleneck | ms/token | tokens/s | "
                  "B/token crossing | planner ms |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['planner']} | - | refused: {r['error']} | | | | |")
            else:
                lines.append(f"| {r['planner']} | {r['devices']} | {r['bottleneck']} | "
                             f"{r['latency_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                             f"{r['bytes_per_token']:,.0f} | {r['planner_ms']:.1f} |")
        lines.append("")
    lines += ["## Planner time, 200 stages", "", "| case | objective | planner s | result |",
              "|---|---|---|---|"]
    for r in results["scale"]:
        lines.append(f"| {r['case']} | {r['objective']} | {r['seconds']:.3f} | {r['result']} |")
    return "\n".join(lines) + "\n"


def scale_cases():
    chain = long_chain(200)
    need = chain.total_param_bytes + sum(chain.kv_bytes(1, CONTEXT).values())
    names, lat, bw, _ = hosts(4, 4, None)
    yield "16 dev (4 kinds: 4 hosts x 4)", chain, Topology(
        names, memory=need / 16 * 1.3, flops=np.repeat([1e12, 2e12, 3e12, 4e12], 4),
        latency=lat, bandwidth=bw)
    names, lat, bw, _ = hosts(2, 8, None)
    yield "16 dev (2 kinds: 2 hosts x 8), ample memory", chain, Topology(
        names, memory=need, flops=np.repeat([1e12, 4e12], 8), latency=lat, bandwidth=bw)
    rng = np.random.default_rng(1)
    names, lat, bw, _ = hosts(2, 4, None)
    yield "8 dev, all different", chain, Topology(
        names, memory=need / 8 * 1.3, flops=rng.uniform(1e12, 4e12, 8),
        latency=lat * rng.uniform(1, 2, (8, 8)), bandwidth=bw)
    names, lat, bw, _ = hosts(4, 4, None)
    yield "16 dev, all different", chain, Topology(
        names, memory=need / 16 * 1.3, flops=rng.uniform(1e12, 4e12, 16),
        latency=lat * rng.uniform(1, 2, (16, 16)), bandwidth=bw)


def main():
    chain = smollm2_chain()
    results = {"batch": BATCH, "context_len": CONTEXT, "clusters": {}, "scale": []}
    for name, topo in clusters(chain).items():
        results["clusters"][name] = [row(chain, topo, m, o) for m, o in PLANNERS]
    for case, chain200, topo in scale_cases():
        for objective in ("latency", "throughput"):
            start = time.perf_counter()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    p = plan(chain200, topo, objective=objective, context_len=CONTEXT)
                how = "beam search" if any("beam" in str(w.message) for w in caught) else "exact"
                result = (f"{len(p.segments())} segments, {p.prediction.latency_s * 1e3:.1f} ms, "
                          f"{how}")
            except PlacementError as e:
                result = f"refused: {str(e)[:80]}"
            results["scale"].append({"case": case, "objective": objective,
                                     "seconds": time.perf_counter() - start, "result": result})
    text = markdown(results)
    write_results("planners", text, results)
    print(text)


if __name__ == "__main__":
    main()
