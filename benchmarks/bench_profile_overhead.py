"""What ``tfnb.profiler.profile()`` costs on the LLM runtime: SmolLM2-135M over 2 local workers.

Greedy, batch 1, ``--new`` new tokens (default 48, EOS off so every call makes them all), the
model split over the two workers by ``tfnb.plan(..., max_memory="400MB")`` (one boundary).
After a warm-up call (which compiles), ``--repeat`` rounds each time, in one round:

* ``plain``: ``placed.generate_ids(...)`` alone;
* ``traced``: the same call inside ``with tfnb.profiler.profile()``, timed around the call only
  (what tracing costs the traced code), and the whole block (plus starting the sessions and
  ending the trace window). What the block defers is timed apart, right after it, as a first
  read of the profile does it: ``collect``, waiting for the workers to hand their traces back
  (``prof.partial``; the workers convert their traces after the block, which is where the fixed
  cost of a capture went, see tfnb/profiler/capture.py), then ``parse`` (``prof.transfers()``).
  ``block + collect`` is what a caller pays who waits for the traces at once.

The order of ``plain`` and ``traced`` alternates per round; figures are medians. The machine is
shared and noisy: compare the ratios of one run. Writes ``benchmarks/results/profile_overhead.md``
and ``.json``.

Run::

    python benchmarks/bench_profile_overhead.py [--new 48] [--repeat 3] [--host-levels 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PROMPT = "Name three colours of the rainbow."


def measure(placed, prompt_ids, new: int, repeat: int, host_level: int, cluster) -> dict:
    import tfnb.profiler
    from tfnb.profiler import capture

    capture.HOST_TRACER_LEVEL = host_level
    plain, traced, block, collect, parse, per_token = [], [], [], [], [], []
    start, stop = [], []
    for i in range(repeat):
        for kind in (("plain", "traced") if i % 2 == 0 else ("traced", "plain")):
            if kind == "plain":
                t0 = time.perf_counter()
                out = placed.generate_ids(prompt_ids, max_new_tokens=new)
                plain.append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                with tfnb.profiler.profile(cluster, timeout=60) as prof:
                    t1 = time.perf_counter()
                    out = placed.generate_ids(prompt_ids, max_new_tokens=new)
                    t2 = time.perf_counter()
                t3 = time.perf_counter()
                traced.append(t2 - t1)
                block.append(t3 - t0)
                start.append(t1 - t0)
                stop.append(t3 - t2)
                partial = prof.partial  # waits for the traces
                t4 = time.perf_counter()
                collect.append(t4 - t3)
                rows = prof.transfers()
                parse.append(time.perf_counter() - t4)
                w0, w1 = placed.devices[:2]
                fwd = [r for r in prof.transfer_edges()
                       if (r["source"], r["destination"]) == (w0, w1)]
                keys = ("source", "destination", "bytes", "count", "unknown")
                per_token.append({"steps": len(out) - 1, "partial": partial,
                                  "loop_edges": [(r["tensor"], r["count"], r["bytes_each"])
                                                 for r in fwd if r["count"] == len(out) - 1],
                                  "transfers": [{k: r[k] for k in keys} for r in rows]})
            assert len(out) == new, (kind, len(out))
    med = statistics.median
    waited = [b + c for b, c in zip(block, collect)]
    return {"host_tracer_level": host_level, "plain_s": plain, "traced_s": traced,
            "block_s": block, "start_s": start, "stop_s": stop, "collect_s": collect,
            "parse_s": parse, "plain_median_s": med(plain), "traced_median_s": med(traced),
            "block_median_s": med(block), "start_median_s": med(start),
            "stop_median_s": med(stop), "collect_median_s": med(collect),
            "parse_median_s": med(parse), "block_collect_median_s": med(waited),
            "traced_ratio": med(traced) / med(plain), "block_ratio": med(block) / med(plain),
            "block_collect_ratio": med(waited) / med(plain),
            "tokens_per_s_plain": new / med(plain), "check": per_token[-1]}


def to_markdown(res: dict) -> str:
    lines = [f"# Profile overhead: SmolLM2-135M, 2 local workers, {res['new_tokens']} new "
             "tokens, greedy, batch 1", "",
             f"{res['machine']}; medians of {res['repeat']} interleaved rounds; {res['when']}.",
             "",
             "| host tracer level | plain s | traced call s | ratio | whole `with` block s | ratio "
             "| collect s (deferred) | parse s (deferred) | block + collect s | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['host_tracer_level']} | {r['plain_median_s']:.3f} | "
                     f"{r['traced_median_s']:.3f} | {r['traced_ratio']:.3f}x | "
                     f"{r['block_median_s']:.3f} | {r['block_ratio']:.3f}x | "
                     f"{r['collect_median_s']:.3f} | {r['parse_median_s']:.3f} | "
                     f"{r['block_collect_median_s']:.3f} | {r['block_collect_ratio']:.3f}x |")
    r = res["runs"][-1]
    lines += ["", f"Inside the block: starting the sessions {r['start_median_s'] * 1e3:.0f} ms, "
              f"ending the trace window {r['stop_median_s'] * 1e3:.0f} ms (medians). `collect` and "
              "`parse` run on the first read of the profile (here right after the block): the "
              "workers convert and send their traces after the window has ended, while this "
              "process goes on."]
    chk = res["runs"][-1]["check"]
    lines += ["", f"Transfers in the last traced call ({chk['steps']} decode steps):", ""]
    for t in chk["transfers"]:
        unknown = f" ({t['unknown']} of unknown size)" if t["unknown"] else ""
        lines.append(f"- {t['source']} -> {t['destination']}: {t['bytes']} B in {t['count']} "
                     f"transfers{unknown}")
    lines += ["", "Worker 0 -> worker 1 edges sent once per decode step (tensor, count, bytes "
              "each): " + ", ".join(f"`{t}` x{c} x {b} B" for t, c, b in chk["loop_edges"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--host-levels", type=int, nargs="+", default=[3])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import platform

    import tfnb

    cluster = tfnb.local(2)
    try:
        model = tfnb.load_model("smollm2", weights="float32", progress=False)  # 400 MB splits
        placed = tfnb.place(model, tfnb.plan(model, cluster, max_memory="400MB"), cluster)
        placed.eos_ids = ()  # every call makes all `new` tokens
        prompt_ids = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
        t0 = time.perf_counter()
        placed.generate_ids(prompt_ids, max_new_tokens=args.new)
        warm = time.perf_counter() - t0
        res = {"new_tokens": args.new, "repeat": args.repeat, "warmup_s": warm,
               "placement": repr(placed),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                          f"Python {platform.python_version()}",
               "when": time.strftime("%Y-%m-%d %H:%M"),
               "runs": [measure(placed, prompt_ids, args.new, args.repeat, lvl, cluster)
                        for lvl in args.host_levels]}
    finally:
        cluster.stop()
    md = to_markdown(res)
    print(md)
    from _results import write_results

    write_results("profile_overhead", md, res, args.out)
    return res


if __name__ == "__main__":
    main()
