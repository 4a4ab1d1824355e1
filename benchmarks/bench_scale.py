"""A model bigger than SmolLM2, split over two workers: where its weights come from, what each
process holds, and its speed beside llama.cpp.

The benchmark writes a GGUF with random Q4_0 weights of a real model's shape once (``--shape
llama-3.2-3b``: 28 blocks, hidden 3072, 24 heads, 8 KV heads, FFN 8192, vocab 128256, 1.8 GB;
``llama-3.1-8b``: 32 blocks, hidden 4096, 32 heads, 8 KV heads, FFN 14336, 4.3 GB) into
``~/.cache/tfnb/scale/`` (block scales chosen so that activations stay finite). Then, each in a
fresh process, with two local workers pinned to one core each and the stages split evenly over
them:

- ``read``: the workers read their stages from the file (``tfnb.place``'s default);
- ``sent``: the client sends every weight (``files=False``, as tfnb did before);
- ``int8``: read as ``read``, multiplied on the int8 route (``activations="int8"``: llama.cpp's
  rounding of the activations, integer dot products);

it reports the seconds of ``load_model`` and ``place``, the anonymous memory (RssAnon) the
client gained loading and placing, and each worker's, the first token's seconds (compiling
included) and decode tokens/s at batch 1 (32 new tokens after a 16-token prompt, best of 3
calls after the one that compiles). Beside it, on the same file (``benchmarks/llama_cpp.py``
builds it): ``llama-bench -p 0 -n 32 -t 2`` (one process, both cores) and its RPC mode over two
``ggml-rpc-server``s pinned to one core each, with the seconds of a run that loads the model
and makes one token (RPC: the weights sent to the servers included); and the time a fresh
process takes to read the file once into its own memory (page cache warm: the file was just
written or read; the memory is new, as a worker's is).

Run::

    python benchmarks/bench_scale.py [--shape llama-3.2-3b]   # writes results/scale.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = {  # blocks, hidden, heads, kv heads, ffn, vocab
    "llama-3.2-3b": (28, 3072, 24, 8, 8192, 128256),
    "llama-3.1-8b": (32, 4096, 32, 8, 14336, 128256),
}
FOLDER = os.path.expanduser("~/.cache/tfnb/scale")
ROWS = ("read", "sent", "int8")
LABELS = {"read": "read by the workers", "sent": "sent from the client",
          "int8": "read by the workers, int8 activations"}


def write_file(shape: str) -> str:
    """The random Q4_0 GGUF of ``shape`` (written once)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    path = os.path.join(FOLDER, f"{shape}-Q4_0.gguf")
    if os.path.exists(path):
        return path
    os.makedirs(FOLDER, exist_ok=True)
    n_layers, hidden, heads, kv_heads, ffn, vocab = SHAPES[shape]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path + ".part", "llama")
    writer.add_name(f"random {shape}")
    writer.add_block_count(n_layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    tokens = ["<unk>", "<s>", "</s>", "t", "1"] + [f"t{i}" for i in range(vocab - 5)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_token_merges(["t 1"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def q4_0(rows: int, cols: int, std: float):
        """Random Q4_0 blocks whose values have about ``std`` (codes -8..7 times d)."""
        blocks = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
        d = np.full((rows, cols // 32, 1), std / 4.6, np.float16)
        blocks[..., :2] = d.view(np.uint8)
        return blocks.reshape(rows, -1)

    def add(name, data, qtype=GGMLQuantizationType.Q4_0):
        writer.add_tensor(name, data, raw_dtype=qtype)

    add("token_embd.weight", q4_0(vocab, hidden, 0.5))
    for i in range(n_layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        add(b + "attn_q.weight", q4_0(hidden, hidden, hidden ** -0.5))
        add(b + "attn_k.weight", q4_0(kv_heads * head_dim, hidden, hidden ** -0.5))
        add(b + "attn_v.weight", q4_0(kv_heads * head_dim, hidden, hidden ** -0.5))
        add(b + "attn_output.weight", q4_0(hidden, hidden, 0.2 * hidden ** -0.5))
        writer.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        add(b + "ffn_gate.weight", q4_0(ffn, hidden, hidden ** -0.5))
        add(b + "ffn_up.weight", q4_0(ffn, hidden, hidden ** -0.5))
        add(b + "ffn_down.weight", q4_0(hidden, ffn, 0.2 * ffn ** -0.5))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    add("output.weight", q4_0(vocab, hidden, hidden ** -0.5))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".part", path)
    return path


def rss_anon_mb(pid="self") -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(s for s in f if s.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024


def run_tfnb(path: str, files: str) -> dict:
    """One placement in this process (``files``: "read", "sent" or "int8"); its figures."""
    import warnings

    import tfnb

    warnings.simplefilter("ignore")
    cluster = tfnb.local(2, cpus=["0", "1"])
    workers = [rss_anon_mb(pid) for pid in cluster.local.pids]
    start = rss_anon_mb()
    t = time.perf_counter()
    model = tfnb.load_model(path, progress=False)
    load_s = time.perf_counter() - t
    loaded = rss_anon_mb()
    t = time.perf_counter()
    placed = tfnb.place(model, cluster.devices[:2], cluster,
                        files=False if files == "sent" else None, progress=False,
                        activations="int8" if files == "int8" else "float32")
    place_s = time.perf_counter() - t
    placed_mb = rss_anon_mb()
    worker_mb = [rss_anon_mb(pid) - w for pid, w in zip(cluster.local.pids, workers)]
    prompt = list(range(3, 19))
    t = time.perf_counter()
    placed.generate_ids(prompt, max_new_tokens=1)
    first_s = time.perf_counter() - t
    placed.generate_ids(prompt, max_new_tokens=32)  # compiles the decode chunks
    rates = []
    for _ in range(3):
        out = placed.generate_ids(prompt, max_new_tokens=32)
        rates.append(placed.last_stats["tokens_per_s"])
    planned = {short: 0 for short in ("worker:0", "worker:1")}
    for stage, device in placed.assignment.items():
        planned["worker:" + device.split("task:")[1][0]] += model.chain[stage].param_bytes
    result = dict(files=files, sources=placed.weight_sources, load_s=load_s, place_s=place_s,
                  client_load_mb=loaded - start, client_place_mb=placed_mb - loaded,
                  worker_mb=worker_mb, planned_mb=[v / 2**20 for v in planned.values()],
                  first_token_s=first_s, decode_tok_s=max(rates), tokens=len(out),
                  model_mb=model.nbytes / 2**20)
    cluster.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-3b", choices=sorted(SHAPES))
    parser.add_argument("--one", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()
    path = write_file(args.shape)
    if args.one:
        print(json.dumps(run_tfnb(path, args.one)))
        return
    read_once_s = float(subprocess.run(  # a fresh process reads it into memory of its own
        [sys.executable, "-c", "import sys, time; t = time.perf_counter(); "
         "data = open(sys.argv[1], 'rb').read(); print(time.perf_counter() - t)", path],
        capture_output=True, text=True, check=True).stdout)
    rows = {}
    for files in ROWS:
        out = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--one", files],
                             capture_output=True, text=True, check=True)
        rows[files] = json.loads(out.stdout.strip().splitlines()[-1])
        print(files, rows[files], flush=True)
    llama = None if args.no_llama_cpp else run_llama_cpp(path)
    write_table(args.shape, path, read_once_s, rows, llama)


def run_llama_cpp(path: str) -> dict:
    """llama.cpp on the same file: one process on both cores, and its RPC mode over two
    ``ggml-rpc-server``s pinned to one core each (weights sent to them at load); the seconds
    of a run that loads and makes one token, then decode tokens/s."""
    from benchmarks import llama_cpp

    llama_cpp.build()
    out = {}

    def timed(**kw) -> float:
        t = time.perf_counter()
        llama_cpp.bench(path, n_gen=1, repeat=1, **kw)
        return time.perf_counter() - t

    out["load_s"] = timed(threads=2)
    out["tok_s"] = llama_cpp.bench(path, threads=2, n_gen=32)
    with llama_cpp.rpc_servers(["0", "1"]) as rpc:
        out["rpc_load_s"] = timed(threads=1, rpc=rpc)
        out["rpc_tok_s"] = llama_cpp.bench(path, threads=1, n_gen=32, rpc=rpc)
    print("llama.cpp", out, flush=True)
    return out


def write_table(shape, path, read_once_s, rows, llama) -> None:
    from benchmarks._results import write_results
    from tfnb.kernels import isa

    size = os.path.getsize(path) / 2**20
    r = rows["read"]
    lines = [f"# Scale: {shape}, random Q4_0 ({size:.0f} MB file), split over 2 workers",
             "",
             f"{time.strftime('%Y-%m-%d %H:%M')}, `python benchmarks/bench_scale.py --shape "
             f"{shape}`; 2 local workers pinned to one core each; tfnb kernels: {isa()}. "
             f"One process reading the file once into new memory (page cache warm): "
             f"{read_once_s:.2f} s. Model "
             f"bytes as placed: {r['model_mb']:.0f} MB; planned per worker: "
             f"{', '.join(f'{v:.0f}' for v in r['planned_mb'])} MB.",
             "",
             "| weights | load s | place s | client MB (load + place) | worker MB (anon) "
             "| first token s | decode tok/s, batch 1 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for files, x in rows.items():
        lines.append(f"| {LABELS[files]} | {x['load_s']:.2f} | {x['place_s']:.2f} | "
                     f"{x['client_load_mb']:.0f} + {x['client_place_mb']:.0f} | "
                     f"{' / '.join(f'{v:.0f}' for v in x['worker_mb'])} | "
                     f"{x['first_token_s']:.1f} | {x['decode_tok_s']:.2f} |")
    if llama is not None:
        i8 = rows["int8"]["decode_tok_s"]
        lines += ["", "| llama.cpp on the same file | load + 1 token s | decode tok/s, batch 1 "
                  "| tfnb's split / it: float32, int8 activations |", "|---|---:|---:|---:|",
                  f"| one process, 2 threads (`llama-bench -p 0 -n 32 -t 2`) | "
                  f"{llama['load_s']:.1f} | {llama['tok_s']:.2f} | "
                  f"{r['decode_tok_s'] / llama['tok_s']:.2f}x, {i8 / llama['tok_s']:.2f}x |",
                  f"| RPC: 2 `ggml-rpc-server`s, one core each (`--rpc ... -ngl 99 -t 1`) | "
                  f"{llama['rpc_load_s']:.1f} | {llama['rpc_tok_s']:.2f} | "
                  f"{r['decode_tok_s'] / llama['rpc_tok_s']:.2f}x, "
                  f"{i8 / llama['rpc_tok_s']:.2f}x |"]
    write_results(f"scale-{shape}", "\n".join(lines) + "\n",
                  dict(shape=shape, file_mb=size, read_once_s=read_once_s, rows=rows,
                       llama_cpp=llama))


if __name__ == "__main__":
    main()
