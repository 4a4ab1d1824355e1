"""tfnb's packed matmul op, float32 activations (the default route) vs int8 activations.

SmolLM2-135M's matrix shapes (out x in: qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, head 49152x576) at N = 1, 2, 4, 8 activation rows, on one core: the process
pins itself to one CPU (``--cpu``, default 1) and TensorFlow runs one intra-op and one
inter-op thread. Weights are random packed rows of ``--qtype`` (SmolLM2's file is Q4_1) with
sane fp16 scales; activations are standard normal.

Three measurements, each the median of ``--repeat`` calls with the two routes interleaved
call by call (the machine is shared and noisy: read ratios within one run):

* per shape, the eager op (as a TF worker runs it outside XLA);
* per shape, the op inside an XLA-compiled function (``jit_compile=True``, as tfnb's
  runtime runs every decode step), one call per function run, dispatch included;
* a full-model equivalent: one compiled function holding all 30 blocks' four matmuls and the
  head, each with its own weights (about 84 MB for Q4_1, so they stream from memory as in a
  real step), chained through cheap elementwise updates.

Times are wall-clock and the process's CPU time; on a busy machine the CPU time is the
steadier figure (it leaves out the time other processes had the core).

Run::

    python benchmarks/bench_kernel.py --smollm2       # writes benchmarks/results/kernel.{md,json}
    python benchmarks/bench_kernel.py --qtype Q8_0 --out /tmp/q8
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np

from tfnb.bench import machine

from _results import RESULTS, write_results

LAYERS = 30
SHAPES = {  # name -> (rows out M, columns in C, how many per step)
    "qkv": (960, 576, LAYERS),
    "o": (576, 576, LAYERS),
    "gate_up": (3072, 576, LAYERS),
    "down": (576, 1536, LAYERS),
    "head": (49152, 576, 1),
}
NS = (1, 2, 4, 8)
ROUTES = ("float32", "int8")


def random_rows(qtype_name: str, M: int, C: int, rng) -> np.ndarray:
    """Random packed rows of ``qtype_name`` whose fp16 scales are small normal numbers."""
    from tfnb import kernels

    qtype = kernels.QTYPES[qtype_name]
    rows = rng.integers(0, 256, (M, kernels.row_bytes(qtype, C)), dtype=np.uint8)
    blocks = rows.reshape(M, C // 32, -1)
    d = rng.uniform(0.005, 0.02, (M, C // 32)).astype(np.float16)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(M, C // 32, 2)
    if qtype_name == "Q4_1":
        blocks[:, :, 2:4] = (-8 * d).view(np.uint8).reshape(M, C // 32, 2)
    return rows


def timed(fn, repeat: int) -> dict:
    """Median wall and CPU milliseconds of ``fn()`` over ``repeat`` calls (after one)."""
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return {"wall_ms": 1e3 * float(np.median(wall)), "cpu_ms": 1e3 * float(np.median(cpu))}


def interleaved(fns: dict, repeat: int) -> dict:
    """``timed`` for several functions, their calls interleaved one by one."""
    for fn in fns.values():
        fn()
    samples = {k: ([], []) for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            samples[k][1].append(time.process_time() - c)
            samples[k][0].append(time.perf_counter() - w)
    return {k: {"wall_ms": 1e3 * float(np.median(w)), "cpu_ms": 1e3 * float(np.median(c))}
            for k, (w, c) in samples.items()}


def bench_shapes(qtype_name: str, repeat: int, rng) -> list[dict]:
    import tensorflow as tf

    from tfnb import kernels

    qtype = kernels.QTYPES[qtype_name]
    out = []
    for name, (M, C, _) in SHAPES.items():
        w = tf.constant(random_rows(qtype_name, M, C, rng))
        reps = max(7, min(repeat, int(repeat * 2e6 / (M * C))))
        for N in NS:
            x = tf.constant(rng.standard_normal((N, C)).astype(np.float32))
            eager = {r: (lambda r=r, x=x, w=w, C=C:
                         kernels.packed_matmul(x, w, qtype, C, r).numpy()) for r in ROUTES}
            xla_fns = {r: tf.function(lambda x, w, r=r, C=C:
                                      kernels.packed_matmul(x, w, qtype, C, r), jit_compile=True)
                       for r in ROUTES}
            xla = {r: (lambda r=r, fns=xla_fns, x=x, w=w: fns[r](x, w).numpy()) for r in ROUTES}
            yf, yi = eager["float32"](), eager["int8"]()
            res = {"shape": name, "M": M, "C": C, "N": N,
                   "rel_rms_err": float(np.sqrt(np.mean((yi - yf) ** 2) / np.mean(yf ** 2))),
                   "rel_max_err": float(np.abs(yi - yf).max() / np.abs(yf).max())}
            for mode, fns in (("eager", eager), ("xla", xla)):
                for r, t in interleaved(fns, reps).items():
                    res[f"{mode}_{r}"] = t
            out.append(res)
            print(f"{name:8s} N={N}: " + "  ".join(
                f"{m} {r} {res[f'{m}_{r}']['cpu_ms']:.3f}" for m in ("eager", "xla")
                for r in ROUTES), flush=True)
    return out


def bench_model(qtype_name: str, repeat: int, rng) -> list[dict]:
    """The full-model equivalent: one compiled function with every matmul of a step."""
    import tensorflow as tf

    from tfnb import kernels

    qtype = kernels.QTYPES[qtype_name]
    layers = [{k: tf.constant(random_rows(qtype_name, M, C, rng))
               for k, (M, C, _) in SHAPES.items() if k != "head"} for _ in range(LAYERS)]
    head = tf.constant(random_rows(qtype_name, *SHAPES["head"][:2], rng))
    D, F = SHAPES["o"][0], SHAPES["down"][1]

    def step(x_NxD, route):
        def mm(x, w, C):
            return kernels.packed_matmul(x, w, qtype, C, route)

        h = x_NxD
        for p in layers:
            h = h + 1e-3 * mm(h, p["qkv"], D)[:, :D]
            h = h + 1e-3 * mm(h, p["o"], D)
            gu = mm(h, p["gate_up"], D)
            h = h + 1e-3 * mm(1e-3 * gu[:, :F] * gu[:, F:], p["down"], F)
        return mm(h, head, D)

    out = []
    fns = {r: tf.function(lambda x, r=r: step(x, r), jit_compile=True) for r in ROUTES}
    for N in NS:
        x = tf.constant(rng.standard_normal((N, D)).astype(np.float32))
        res = {"N": N, **interleaved({r: (lambda r=r, x=x: fns[r](x).numpy()) for r in ROUTES},
                                     max(5, repeat // 4))}
        out.append(res)
        print(f"model N={N}: " + "  ".join(f"{r} {res[r]['cpu_ms']:.1f} ms (wall "
                                           f"{res[r]['wall_ms']:.1f})" for r in ROUTES),
              flush=True)
    return out


BIG = (14336, 4096, 8)  # Llama-3.1-8B's FFN matrices, 8 of them: far past any L3 cache


def read_bandwidth() -> float:
    """GB/s one core reads memory at (numpy summing 512 MB, best of 5)."""
    a = np.ones(512 << 20, np.uint8).view(np.uint64)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def bench_big(qtype_name: str, repeat: int, rng) -> dict:
    """Weights larger than the cache, as a big model's decode streams them: one compiled
    function multiplying ``BIG``'s matrices in turn, at 1 and 8 activation rows; GB/s of
    weights against one core's read bandwidth."""
    import tensorflow as tf

    from tfnb import kernels

    M, C, count = BIG
    qtype = kernels.QTYPES[qtype_name]
    ws = [tf.constant(random_rows(qtype_name, M, C, rng)) for _ in range(count)]
    nbytes = sum(int(np.prod(w.shape)) for w in ws)
    fns = {r: tf.function(lambda x, r=r: tf.add_n([tf.reduce_sum(
        kernels.packed_matmul(x, w, qtype, C, r)) for w in ws]), jit_compile=True)
        for r in ROUTES}
    out = {"M": M, "C": C, "count": count, "bytes": nbytes, "read_gb_s": read_bandwidth(),
           "rows": []}
    for N in (1, 8):
        x = tf.constant(rng.standard_normal((N, C)).astype(np.float32))
        res = {"N": N, **interleaved({r: (lambda r=r, x=x: fns[r](x).numpy()) for r in ROUTES},
                                     max(5, repeat // 8))}
        for r in ROUTES:
            res[r]["gb_s"] = nbytes / (res[r]["wall_ms"] / 1e3) / 1e9
        out["rows"].append(res)
        print(f"big N={N}: " + "  ".join(f"{r} {res[r]['wall_ms']:.1f} ms "
                                         f"({res[r]['gb_s']:.1f} GB/s)" for r in ROUTES),
              flush=True)
    return out


QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.",
             "Explain what a CPU cache is.", "Name three primary colors.", "What is 12 times 7?"]


def bench_smollm2_logits() -> list[dict]:
    """SmolLM2's prompt logits with each route (``place(..., activations=)``; one local
    worker; a prompt is under ``DEQUANTIZE_ROWS`` rows, so it uses the kernel)."""
    import warnings

    import tfnb
    from tfnb.cluster import LocalCluster

    lc = LocalCluster(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cluster = tfnb.connect(lc, timeout=30.0)
        model = tfnb.load_model("smollm2", progress=False)
        tok = model.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
                   for q in QUESTIONS]
        logits = {}
        for route in ROUTES:
            placed = tfnb.place(model, [cluster.devices[0]], cluster, activations=route)
            logits[route] = [np.asarray(placed.logits([p])).reshape(len(p), -1) for p in prompts]
            del placed
    finally:
        lc.close()
    out = []
    for q, f, i in zip(QUESTIONS, logits["float32"], logits["int8"]):
        top2 = np.argsort(f[-1])[::-1][:2]
        out.append({"question": q, "tokens": int(f.shape[0]),
                    "max_err_over_ptp": float(np.abs(i - f).max() / np.ptp(f)),
                    "rms_err_over_std": float(np.sqrt(np.mean((i - f) ** 2)) / np.std(f)),
                    "argmax_agree": float(np.mean(f.argmax(-1) == i.argmax(-1))),
                    "next_float32": tok.decode([int(top2[0])]),
                    "margin_float32": float(f[-1, top2[0]] - f[-1, top2[1]]),
                    "next_int8": tok.decode([int(i[-1].argmax())])})
        print(out[-1], flush=True)
    return out


def markdown(qtype_name: str, shapes: list[dict], model: list[dict], cpu: int,
             logits: list[dict] | None = None, big: dict | None = None) -> str:
    import tensorflow as tf

    lines = [f"# Packed matmul: float32 vs int8 activations ({qtype_name}, 1 core)", "",
             f"`benchmarks/bench_kernel.py`, TF {tf.__version__}, pinned to CPU {cpu}, one "
             "intra-op thread. Medians of interleaved calls; CPU ms of the process (wall ms "
             "in the JSON). The machine is shared: compare within a table.", "",
             f"Machine: {machine()}.", "",
             "## Full-model equivalent (one XLA function: 30 blocks x 4 matmuls + head)", "",
             "| N | float32 ms/step | int8 ms/step | speedup | float32 wall | int8 wall |",
             "|---|---|---|---|---|---|"]
    for r in model:
        f, i = r["float32"], r["int8"]
        lines.append(f"| {r['N']} | {f['cpu_ms']:.1f} | {i['cpu_ms']:.1f} | "
                     f"{f['cpu_ms'] / i['cpu_ms']:.2f}x | {f['wall_ms']:.1f} | "
                     f"{i['wall_ms']:.1f} |")
    from tfnb import kernels

    lines += ["", f"Code: float32 route `{kernels.isa()}`, int8 route `{kernels.int8_isa()}` "
              "(`--isa avx2` caps both at AVX2, written to kernel_avx2.md)."]
    if big:
        lines += ["", f"## Larger than the cache: {big['count']} matrices of "
                  f"{big['M']}x{big['C']} ({big['bytes'] / 1e6:.0f} MB), one XLA function", "",
                  f"One core reads memory at {big['read_gb_s']:.1f} GB/s (numpy, 512 MB).", "",
                  "| N | float32 ms | GB/s | int8 ms | GB/s | speedup |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in big["rows"]:
            f, i = r["float32"], r["int8"]
            lines.append(f"| {r['N']} | {f['wall_ms']:.1f} | {f['gb_s']:.1f} | "
                         f"{i['wall_ms']:.1f} | {i['gb_s']:.1f} | "
                         f"{f['wall_ms'] / i['wall_ms']:.2f}x |")
    if logits:
        lines += ["", "## Accuracy: SmolLM2-135M (Q4_1) prompt logits, int8 vs float32 route", "",
                  "| prompt | tokens | max err / ptp | rms err / std | argmax agree | next "
                  "(float32, margin) | next (int8) |", "|---|---|---|---|---|---|---|"]
        for r in logits:
            lines.append(f"| {r['question']} | {r['tokens']} | {r['max_err_over_ptp']:.3f} | "
                         f"{r['rms_err_over_std']:.3f} | {r['argmax_agree']:.3f} | "
                         f"{r['next_float32']!r} ({r['margin_float32']:.2f}) | "
                         f"{r['next_int8']!r} |")
    if not shapes:
        return "\n".join(lines) + "\n"
    lines += ["", "Sum of the per-shape XLA calls x their count per step (dispatch included):",
              "", "| N | float32 ms | int8 ms | speedup |", "|---|---|---|---|"]
    for N in NS:
        tot = {r: sum(s[f"xla_{r}"]["cpu_ms"] * SHAPES[s["shape"]][2]
                      for s in shapes if s["N"] == N) for r in ROUTES}
        lines.append(f"| {N} | {tot['float32']:.1f} | {tot['int8']:.1f} | "
                     f"{tot['float32'] / tot['int8']:.2f}x |")
    lines += ["", "## Per shape (ms per call)", "",
              "| shape | M x C | N | eager float32 | eager int8 | speedup | XLA float32 | "
              "XLA int8 | speedup | int8 rel. rms err |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in shapes:
        ef, ei = s["eager_float32"]["cpu_ms"], s["eager_int8"]["cpu_ms"]
        xf, xi = s["xla_float32"]["cpu_ms"], s["xla_int8"]["cpu_ms"]
        lines.append(f"| {s['shape']} | {s['M']}x{s['C']} | {s['N']} | {ef:.3f} | {ei:.3f} | "
                     f"{ef / ei:.2f}x | {xf:.3f} | {xi:.3f} | {xf / xi:.2f}x | "
                     f"{s['rel_rms_err']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qtype", default="Q4_1", choices=["Q4_0", "Q4_1", "Q8_0"])
    ap.add_argument("--repeat", type=int, default=41, help="calls per median (small shapes)")
    ap.add_argument("--cpu", type=int, default=1, help="the one CPU to run on")
    ap.add_argument("--skip-shapes", action="store_true", help="only the full-model function")
    ap.add_argument("--smollm2", action="store_true",
                    help="also compare SmolLM2's prompt logits between the routes (one worker)")
    ap.add_argument("--out", default=RESULTS, help="directory for kernel.md / kernel.json")
    ap.add_argument("--isa", choices=["avx2", "portable"],
                    help="cap the kernels' code ($TFNB_PACKED_ISA) below the CPU's best")
    args = ap.parse_args(argv)
    if args.isa:
        os.environ["TFNB_PACKED_ISA"] = args.isa
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(0)
    shapes = [] if args.skip_shapes else bench_shapes(args.qtype, args.repeat, rng)
    model = bench_model(args.qtype, args.repeat, rng)
    big = bench_big(args.qtype, args.repeat, rng)
    logits = bench_smollm2_logits() if args.smollm2 else None
    md = markdown(args.qtype, shapes, model, args.cpu, logits, big)
    name = "kernel" + ("" if args.qtype == "Q4_1" else f"_{args.qtype}") + (
        f"_{args.isa}" if args.isa else "")
    write_results(name, md, {"qtype": args.qtype, "shapes": shapes, "model": model,
                             "big": big, "smollm2_logits": logits}, args.out)
    print(md)


if __name__ == "__main__":
    main()
