"""Concurrent requests on SmolLM2-135M: tfnb on one worker, split over two and replicated on two,
against Hugging Face XLA (the same requests batched) and llama.cpp's ``llama-server`` (its own
continuous batching; alone and over two RPC servers).

Every tfnb worker and every llama.cpp process that computes is pinned to one core (``taskset``),
so the two-worker configurations have twice the cores of the single one, as two machines
would. ``C`` clients (C = 1, 2, 4, 8, 16) each send ``--requests`` greedy requests of ``--new``
new tokens (EOS off, so every request makes them all); the figure is the aggregate tokens per
second of the round and the median and 95th percentile of the requests' latencies. At 8
clients, where the targets are read, each configuration runs 5 rounds and the median round
counts (all five are in the JSON and the summary, with the median of the two-worker
configurations' round-by-round ratios to the single worker: their rounds take turns, so each
ratio compares rounds a few seconds apart): single rounds of one configuration varied by
10-25% on the 2-core machine. Each tfnb round also records every worker's CPU time over the
round's wall time: how busy each core was, and how much CPU a token cost in all.

Each client sends 4 requests a round by default. A round ends with its last request, and on
two replicas the copy that finishes its share first idles until the other is done: traced call
by call on a Zen 3 machine with 2 requests per client, one replica idled 0.2-0.55 s at the end
of each 4-6 s round while its calls otherwise ran back to back (under 2 ms between them). A
server with a steady stream of requests has no such end; a single worker, one queue, has none
either. 4 requests per client halve that end's share of the round (the same probe, alternated:
the replicas 1.74-1.82x one worker with 2 requests per client, 1.84-1.91x with 4).

The three tfnb configurations are placed at once on one cluster of two workers, each pinned to
a core, and their rounds interleave (the single worker is worker 0 alone):

* ``tfnb 1 worker``: the model on one worker; concurrent requests share its batch;
* ``tfnb split``: a plan capped at 100 MB per worker, so each holds half the blocks; one lane
  of cache rows per worker, so two batches keep both busy;
* ``tfnb replicas``: ``tfnb.plan(mode="replicate")``, a full copy per worker;
* ``HF XLA``: ``generate`` under ``jit_compile`` in this process (2 cores), the C requests of a
  round as one batch;
* ``llama.cpp``: ``llama-server -t 1 -np 16`` on core 0, and with ``--rpc`` over two
  ``ggml-rpc-server``s on cores 0 and 1; requests through its OpenAI API.

The tfnb configurations also run 5 rounds of 8 clients streaming their requests in 4-token
chunks, as ``tfnb.serve`` streams (one decode call per chunk, so four times the calls).

For the tfnb configurations the planner's predicted throughput at 8 concurrent requests is set
beside the measurement: ``tfnb.plan(..., prompt_len=..., new_tokens=...)`` calibrates the stage
times on the workers at the batch each lane or copy then runs, attending the slots these
requests reach (not the lane's whole cache), and each request's prefill too (the figure counts
both); the figure is that of the placed plan (``Plan.from_assignment`` on the calibrated
topology), with the planner's own plan beside it where it cuts elsewhere, and its decode
steps' rate alone is given as well. That calibration runs once, after all the rounds, and the
machine's speed moves by up to a third within minutes, so the same cost model is also fed
stage times taken between the rounds at 8 requests (the calibration's own timed loops, built
once by ``tfnb.placement.planners.topology_timer``, timed once before every cycle of rounds,
the median of the five counts): that figure tells the cost model's own error apart from the
machine's drift. The machine is shared and noisy: compare the ratios of one run. Writes
``benchmarks/results/serving.md`` and ``.json``.

Run::

    python benchmarks/bench_serving.py [--new 48] [--requests 4] [--skip hf llama.cpp]
"""
from __future__ import annotations

import argparse
import functools
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
CONCURRENCY = (1, 2, 4, 8, 16)
PREDICT_AT = 8
REPEATS_AT = 5  # rounds at PREDICT_AT requests (the targets' point): the median one counts
STREAM_CHUNK = 4  # tokens per streamed event, as tfnb.serve streams (a decode call each)


def round_of(send, clients: int, requests: int, new: int) -> dict:
    """``clients`` threads, ``requests`` calls of ``send()`` (which returns the tokens it got)
    each; aggregate tokens/s and latencies."""
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client():
        for _ in range(requests):
            t0 = time.perf_counter()
            n = send()
            with lock:
                latencies.append(time.perf_counter() - t0)
                tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    assert tokens[0] == clients * requests * new, (tokens[0], clients, requests, new)
    latencies.sort()
    return {"clients": clients, "tokens_per_s": tokens[0] / wall,
            "p50_s": statistics.median(latencies),
            "p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]}


def busy_round(send, clients: int, requests: int, new: int, pids) -> dict:
    """:func:`round_of`, with each worker process's CPU seconds over the round's wall time
    (``worker_busy``, one figure per pid): how much of the round each core computed."""
    import psutil

    procs = [psutil.Process(p) for p in pids]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    r = round_of(send, clients, requests, new)
    wall = clients * requests * new / r["tokens_per_s"]
    r["worker_busy"] = [(sum(p.cpu_times()[:2]) - b) / wall for p, b in zip(procs, before)]
    return r


def median_round(runs: list[dict]) -> dict:
    """The round of median throughput among ``runs``, with every run's figure beside it."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ranked[len(ranked) // 2], "repeats": [r["tokens_per_s"] for r in runs]}


def interleaved(sends: dict, clients: int, requests: int, new: int, repeats: int,
                measure, between=None) -> dict:
    """Per configuration (``{name: send}``), the median of ``repeats`` rounds of ``clients``
    measured by ``measure(send, clients, requests, new)``, the configurations' rounds taking
    turns, after one unmeasured round each (it compiles the batch and window sizes the round
    reaches); ``between()`` is called before every cycle of rounds."""
    for send in sends.values():
        round_of(send, clients, requests, new)
    runs = {name: [] for name in sends}
    for _ in range(repeats):
        if between is not None:
            between()
        for name, send in sends.items():
            runs[name].append(measure(send, clients, requests, new))
    return {name: median_round(r) for name, r in runs.items()}


def rounds(send, requests: int, new: int) -> list[dict]:
    out = []
    for c in CONCURRENCY:
        out.append(interleaved({"": send}, c, requests, new,
                               REPEATS_AT if c == PREDICT_AT else 1, round_of)[""])
    print([f"{r['clients']}: {r['tokens_per_s']:.1f}" for r in out], flush=True)
    return out


CONFIGS = (("tfnb 1 worker", 1, {}), ("tfnb split", 2, {"max_memory": "100MB"}),
           ("tfnb replicas", 2, {"mode": "replicate"}))


def bench_tfnb(model, prompt_ids, requests: int, new: int, predict: bool = True,
               only=None) -> dict:
    """Every configuration placed at once on one cluster of two workers pinned to a core each
    (the single-worker configuration on worker 0 alone), their rounds interleaved: a slow spell
    of the machine, which can last a minute here, then falls on every configuration alike and
    leaves their ratios be."""
    import tfnb
    from tfnb.placement import Plan
    from tfnb.placement.planners import as_topology, topology_timer

    configs = [c for c in CONFIGS if not only or c[0].split()[-1] in only]
    cluster = tfnb.local(2, cpus=["0", "1"])
    try:
        placed, streamed, results, assignments = {}, {}, {}, {}
        for name, n_workers, how in configs:
            devices = list(cluster.devices[:n_workers])
            plan = tfnb.plan(model, cluster, calibrate=False, devices=devices, **how)
            pm = tfnb.place(model, plan, cluster)
            copies = getattr(pm, "replicas", [pm])
            for copy in copies:  # the default 8 cache rows per lane: 16 requests queue half
                copy.eos_ids = ()
            placed[name] = (lambda pm=pm: len(pm.generate_ids(prompt_ids, max_new_tokens=new)))
            streamed[name] = (lambda pm=pm: sum(len(c) for c in pm.generate_ids(
                prompt_ids, max_new_tokens=new, stream=True, chunk_tokens=STREAM_CHUNK)))
            results[name] = {"rounds": [], "plan": str(plan.segments()),
                             "lanes": len(copies) * len(copies[0].scheduler.lanes)}
            assignments[name] = plan.assignment
        # the stages timed between the rounds at 8 requests, once per cycle, each at the batch
        # its configuration's lanes or copies then run (timers built and compiled here once)
        timers, samples, timed_as = {}, {}, {}
        for name, n_workers, _how in configs if predict else ():
            # rows per lane at 8 requests (a copy of a replicated plan is one lane here)
            key = timed_as[name] = (-(-PREDICT_AT // results[name]["lanes"]), n_workers)
            if key not in timers:
                timers[key] = topology_timer(cluster, model, key[0], 256, len(prompt_ids),
                                             list(cluster.devices[:n_workers]), new)
                samples[key] = []

        def time_stages():
            for key, timer in timers.items():
                samples[key].append(timer(1))

        for c in CONCURRENCY:
            medians = interleaved(placed, c, requests, new, REPEATS_AT if c == PREDICT_AT else 1,
                                  lambda *a: busy_round(*a, cluster.local.pids),
                                  time_stages if c == PREDICT_AT else None)
            for name, r in medians.items():
                results[name]["rounds"].append(r)
            print(c, {n: round(r["tokens_per_s"], 1) for n, r in medians.items()}, flush=True)
        # streamed as the HTTP endpoint streams: a decode call per STREAM_CHUNK tokens
        medians = interleaved(streamed, PREDICT_AT, requests, new, REPEATS_AT, round_of)
        for name, r in medians.items():
            results[name]["streamed_at_8"] = r
        print("streamed", {n: round(r["tokens_per_s"], 1) for n, r in medians.items()},
              flush=True)
        placed.clear()
        streamed.clear()
        for name, n_workers, how in configs if predict else ():
            # the planner's figure for 8 requests: each lane runs 8 / lanes of them (a
            # replicated plan splits the batch over its copies itself), over a lane's caches
            # (256 slots), its decode steps timed attending what these requests reach (the
            # prompt's 48 padded tokens and 48 new ones), the prefill of this prompt timed too
            batch = PREDICT_AT if how.get("mode") == "replicate" else \
                PREDICT_AT // results[name]["lanes"]
            devices = list(cluster.devices[:n_workers])
            # the same figure from the stages timed between the rounds (their medians)
            timed = median_topology(samples[timed_as[name]])
            rounds_plan = tfnb.plan(model, timed, batch=batch, context_len=256,
                                    prompt_len=len(prompt_ids), new_tokens=new, **how) \
                if how.get("mode") == "replicate" else \
                Plan.from_assignment(model.chain, assignments[name], timed, batch, 256,
                                     prompt_len=len(prompt_ids), new_tokens=new)
            results[name]["rounds_predicted_at_8"] = rounds_plan.prediction.throughput
            try:
                planned = tfnb.plan(model, cluster, batch=batch, context_len=256,
                                    prompt_len=len(prompt_ids), new_tokens=new,
                                    devices=devices, **how)
                predicted = planned
                if not planned.replicas:  # the figures of the measured cut, which the planner
                    # may have drawn elsewhere (the topology is the one it calibrated, cached)
                    topo = as_topology(cluster, model, batch, 256, len(prompt_ids), devices, new)
                    predicted = Plan.from_assignment(model.chain, assignments[name], topo, batch,
                                                     256, prompt_len=len(prompt_ids),
                                                     new_tokens=new)
                results[name].update(predicted_at_8=predicted.prediction.throughput,
                                     predicted_decode_at_8=predicted.prediction.decode_throughput,
                                     planned=str(planned.segments()),
                                     planned_at_8=planned.prediction.throughput)
            except tfnb.errors.PlacementError as e:
                print(name, "no prediction:", e, flush=True)
            print(name, results[name].get("predicted_at_8"), flush=True)
        return results
    finally:
        cluster.stop()


def median_topology(samples: list):
    """A topology whose stage and prefill times are the medians of ``samples`` (topologies
    timed alike, between rounds)."""
    import numpy as np

    def median(tables):
        return {k: float(np.median([t[k] for t in tables])) for k in tables[0]}

    return samples[0].with_stage_times(median([s.stage_times for s in samples])) \
        .with_prefill_times(median([s.prefill_times for s in samples]))


def bench_hf(model, prompt_ids, requests: int, new: int) -> dict:
    import tensorflow as tf

    hf = model.to_hf()
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = None
    generate = tf.function(hf.generate, jit_compile=True)
    out = []
    for c in CONCURRENCY:
        ids = tf.constant([prompt_ids] * c, tf.int32)
        run = functools.partial(generate, ids, max_new_tokens=new, do_sample=False,
                                pad_token_id=0)
        run()  # compile
        runs = []
        for _ in range(REPEATS_AT if c == PREDICT_AT else 1):
            lat = []
            start = time.perf_counter()
            for _ in range(requests):
                t0 = time.perf_counter()
                run()
                lat += [time.perf_counter() - t0] * c
            wall = time.perf_counter() - start
            lat.sort()
            runs.append({"clients": c, "tokens_per_s": c * requests * new / wall,
                         "p50_s": statistics.median(lat),
                         "p95_s": lat[int(0.95 * (len(lat) - 1))]})
        out.append(median_round(runs))
    print("HF", [f"{r['clients']}: {r['tokens_per_s']:.1f}" for r in out], flush=True)
    return {"HF XLA (batched)": {"rounds": out}}


def bench_llama_cpp(gguf_path: str, prompt_text: str, requests: int, new: int) -> dict:
    import openai

    from benchmarks import llama_cpp

    llama_cpp.build()
    results = {}

    def sender(url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300)

        def send():
            r = client.completions.create(model="smollm2", prompt=prompt_text, max_tokens=new,
                                          temperature=0, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens
        return send

    with llama_cpp.server(gguf_path, 1, max(CONCURRENCY), cpus="0") as url:
        results["llama.cpp server, 1 core"] = {"rounds": rounds(sender(url), requests, new)}
    with llama_cpp.rpc_servers(["0", "1"]) as rpc:
        with llama_cpp.server(gguf_path, 1, max(CONCURRENCY), rpc=rpc) as url:
            results["llama.cpp server, RPC 2 x 1 core"] = {
                "rounds": rounds(sender(url), requests, new)}
    return results


def table(results: dict) -> str:
    names = list(results)
    head = "| concurrent requests | " + " | ".join(names) + " |"
    rows = [head, "|---" * (len(names) + 1) + "|"]
    for i, c in enumerate(CONCURRENCY):
        cells = []
        for n in names:
            r = results[n]["rounds"][i]
            cells.append(f"{r['tokens_per_s']:.1f} ({r['p50_s']:.2f} / {r['p95_s']:.2f})")
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary(results: dict) -> str:
    at = CONCURRENCY.index(PREDICT_AT)
    rate = {n: r["rounds"][at]["tokens_per_s"] for n, r in results.items()}
    lines = [f"- at {PREDICT_AT} requests, the median of {REPEATS_AT} rounds: " + "; ".join(
        f"{n} " + ", ".join(f"{x:.1f}" for x in r["rounds"][at].get("repeats", []))
        for n, r in results.items())]
    one = rate.get("tfnb 1 worker")
    for n in ("tfnb split", "tfnb replicas"):
        if n in rate and one:
            # the configurations' rounds take turns: round i of each ran in the same cycle
            paired = [a / b for a, b in zip(results[n]["rounds"][at].get("repeats", []),
                                            results["tfnb 1 worker"]["rounds"][at].get(
                                                "repeats", []))]
            lines.append(f"- {n} / tfnb 1 worker at {PREDICT_AT} requests: "
                         f"{rate[n] / one:.2f}x (target >= 1.7x)" + (
                             f"; round by round {min(paired):.2f}-{max(paired):.2f}x, median "
                             f"{statistics.median(paired):.2f}x" if paired else ""))
        rpc = rate.get("llama.cpp server, RPC 2 x 1 core")
        if n in rate and rpc:
            lines.append(f"- {n} / llama.cpp RPC at {PREDICT_AT} requests: {rate[n] / rpc:.2f}x "
                         "(target >= 1x)")
    busy = {n: r["rounds"][at]["worker_busy"] for n, r in results.items()
            if "worker_busy" in r["rounds"][at]}
    if busy:
        lines.append("- CPU time of each worker over the wall time of that round (worker 0, 1): "
                     + "; ".join(f"{n} " + ", ".join(f"{b:.0%}" for b in bs)
                                 for n, bs in busy.items()))
    one_cpu = sum(busy.get("tfnb 1 worker", [])) / one if one and busy else None
    for n in ("tfnb split", "tfnb replicas"):
        if one_cpu and n in busy:  # CPU seconds per token, against one worker's
            per_token = sum(busy[n]) / rate[n] / one_cpu
            lines.append(f"- {n}: both workers' CPU time per token {per_token:.2f}x one worker's")
    streamed = {n: r["streamed_at_8"] for n, r in results.items() if "streamed_at_8" in r}
    if streamed:
        lines.append(f"- streamed in {STREAM_CHUNK}-token chunks (as `tfnb.serve` streams) at "
                     f"{PREDICT_AT} requests, the median of {REPEATS_AT} rounds: " + "; ".join(
                         f"{n} {r['tokens_per_s']:.1f} (" + ", ".join(
                             f"{x:.1f}" for x in r["repeats"]) + ")"
                         for n, r in streamed.items()))
    for n, r in results.items():
        if "predicted_at_8" in r:
            p = r["predicted_at_8"]
            lines.append(f"- {n}: planner predicted {p:.1f} tokens/s at {PREDICT_AT} requests "
                         "(prefills included; decode steps alone "
                         f"{r['predicted_decode_at_8']:.1f}), measured {rate[n]:.1f} "
                         f"({rate[n] / p - 1:+.0%})" + (
                             f"; from the stages timed between the rounds "
                             f"{r['rounds_predicted_at_8']:.1f} ("
                             f"measured {rate[n] / r['rounds_predicted_at_8'] - 1:+.0%})"
                             if "rounds_predicted_at_8" in r else "") +
                         f"; {r['lanes']} lane(s)"
                         + ("" if r.get("planned") in (None, r.get("plan")) else
                            f"; the planner's own cut {r['planned']} predicts "
                            f"{r['planned_at_8']:.1f}"))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--skip", nargs="*", default=[], choices=["tfnb", "hf", "llama.cpp"])
    ap.add_argument("--only", nargs="*", choices=["worker", "split", "replicas"],
                    help="tfnb configurations to run (default: all)")
    ap.add_argument("--no-predict", action="store_true",
                    help="skip the planner's calibrated predictions (minutes per configuration)")
    args = ap.parse_args()

    import tfnb
    from benchmarks._results import write_results
    from tfnb.bench import machine
    from tfnb.cluster.security import ExposedServerWarning
    from tfnb.models.model import smollm2_path

    warnings.simplefilter("ignore", ExposedServerWarning)
    model = tfnb.load_model("smollm2")
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    ids = model.tokenizer.encode(text)
    results = {}
    if "tfnb" not in args.skip:
        results.update(bench_tfnb(model, ids, args.requests, args.new, not args.no_predict,
                                  args.only))
    if "hf" not in args.skip:
        results.update(bench_hf(model, ids, args.requests, args.new))
    if "llama.cpp" not in args.skip:
        results.update(bench_llama_cpp(smollm2_path(), text, args.requests, args.new))
    md = (f"# Concurrent requests: SmolLM2-135M (Q4_1 GGUF), greedy, {args.new} new tokens\n\n"
          f"{time.strftime('%Y-%m-%d %H:%M')}; {machine()}; "
          f"{args.requests} requests per client per round; "
          "aggregate tokens/s (p50 / p95 latency, s). Every computing process pinned to one "
          "core, HF XLA on 2 cores.\n\n" + table(results) + "\n\n" + summary(results) + "\n")
    write_results("serving", md, {"new": args.new, "requests": args.requests, **results})
    print(md)


if __name__ == "__main__":
    main()
