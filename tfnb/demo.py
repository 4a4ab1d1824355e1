"""``tfnb demo``: the whole path once, on this machine, with each long step announced.

Starts a local cluster of two TF workers, loads SmolLM2, places it automatically over both,
answers a question, profiles a second answer, writes the profile figure and the executed
quickstart notebook, and says where they are.
"""
from __future__ import annotations

import os
import tempfile
import time
import warnings
from pathlib import Path


def _step(text: str) -> float:
    print(f"\n== {text}", flush=True)
    return time.perf_counter()


def execute_notebook(nb, cwd, timeout: float = 900) -> None:
    """Run every cell of the notebook ``nb`` (nbformat) in place, in a fresh ``python3`` kernel
    working in the folder ``cwd``.

    The kernel talks to this process over local sockets (IPC, on POSIX systems), not TCP:
    nothing else on the network can reach it, and it has no unencrypted-TCP warning to print.

    Examples
    --------
    >>> import nbformat
    >>> nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    >>> execute_notebook(nb, ".")                       # doctest: +SKIP
    >>> nb.cells[0].outputs[0].text                     # doctest: +SKIP
    '42\\n'
    """
    from nbclient import NotebookClient
    from traitlets.config import Config

    with tempfile.TemporaryDirectory(prefix="tfnb-kernel-") as sockets:
        config = Config()
        if os.name == "posix":  # (Windows has no IPC sockets: TCP there)
            config.KernelManager.transport = "ipc"
            config.KernelManager.ip = os.path.join(sockets, "kernel")
        NotebookClient(nb, timeout=timeout, kernel_name="python3", config=config,
                       resources={"metadata": {"path": str(cwd)}}).execute()


def run_demo(out_dir: str = "demo-output", notebook: str | None = "notebooks/01-quickstart.ipynb",
             model: str = "smollm2") -> dict:
    """Run the demo; returns the paths it wrote and the answer.

    ``model="tiny"`` runs the same steps with a small random model (no cap on memory), in
    seconds instead of minutes: a check of the path, not of the answers.

    Examples
    --------
    >>> run_demo("demo-output")             # doctest: +SKIP
    """
    import tfnb
    from tfnb.cluster.security import ExposedServerWarning
    from tfnb.errors import ModelError
    from tfnb.models import tiny

    which = model
    if which not in ("smollm2", "tiny"):
        raise ModelError(f"model={which!r}; the demo runs 'smollm2' or 'tiny'")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = _step("starting a local cluster of 2 TF workers")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExposedServerWarning)
        cluster = tfnb.local(2)
    for w in caught:
        print(f"security: {w.message}")
    print(cluster.status(), f"\n({time.perf_counter() - t:.1f} s)")
    try:
        if which == "tiny":
            t = _step("making a tiny random llama (a check of the path: its answers are noise)")
            model = tiny("llama")
            cap = None
        else:
            t = _step("loading SmolLM2-135M-Instruct from its package (no network)")
            model = tfnb.load_model("smollm2", progress=False)  # the step is announced
            cap = "100MB"
        print(model, f"({time.perf_counter() - t:.1f} s)")
        t = _step("planning: measuring the cluster, then the optimal split"
                  + (f" under a {cap} cap per worker" if cap else ""))
        plan = tfnb.plan(model, cluster, max_memory=cap)
        print(plan, f"\n({time.perf_counter() - t:.1f} s)")
        t = _step("placing the weights on the workers")
        placed = tfnb.place(model, plan, cluster)
        print(placed, f"({time.perf_counter() - t:.1f} s)")
        question = "What is the capital of France?"
        t = _step(f"asking {question!r} (the first call compiles the graph: about half a minute)")
        answer = placed.chat(question, max_new_tokens=24)
        print(answer, f"\n({time.perf_counter() - t:.1f} s)")
        t = _step("profiling a second answer across both workers")
        with tfnb.profile(cluster) as prof:
            placed.chat("What is the capital of Italy?", max_new_tokens=24)
        print(prof)
        figure = out / "profile.png"
        prof.save(figure)
        print(f"({time.perf_counter() - t:.1f} s)")
    finally:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ExposedServerWarning)
            cluster.stop()
        for w in caught:  # this process's own TF server listens until the demo ends
            if issubclass(w.category, ExposedServerWarning):
                print(f"security: {w.message}")
    written = {"profile_figure": str(figure.resolve()), "answer": answer}
    if notebook and Path(notebook).exists():
        t = _step(f"running the quickstart notebook {notebook} (a fresh kernel and cluster, "
                  "a few minutes)")
        import nbformat

        nb = nbformat.read(notebook, as_version=4)
        execute_notebook(nb, out)
        executed = out / Path(notebook).name
        nbformat.write(nb, executed)
        written["notebook"] = str(executed.resolve())
        print(f"({time.perf_counter() - t:.1f} s)")
    print("\n== done. Wrote:")
    for k, v in written.items():
        if k != "answer":
            print(f"  {k}: {v}")
    return written
