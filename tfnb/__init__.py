"""tfnb: run a pretrained LLM across a TensorFlow cluster from a Jupyter notebook.

Examples
--------
>>> import tfnb                                          # doctest: +SKIP
>>> cluster = tfnb.local(2)          # two TF workers on this machine      # doctest: +SKIP
>>> model = tfnb.load_model("smollm2")   # a real LLM, from disk           # doctest: +SKIP
>>> placed = tfnb.place(model, cluster.devices)  # split across the workers  # doctest: +SKIP
>>> placed.chat("What is the capital of France?")                         # doctest: +SKIP
"""
import os as _os

# Hugging Face's TF models need Keras 2; both settings only act if set before TF is imported.
_os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfnb.errors import TfnbError

__version__ = "0.1.0"

# Public names, imported on first use so that `import tfnb` and `%load_ext tfnb` stay fast and
# do not import TensorFlow.
_LAZY = {
    "Cluster": "tfnb.cluster", "ClusterSpec": "tfnb.cluster", "LocalCluster": "tfnb.cluster",
    "connect": "tfnb.cluster", "local": "tfnb.cluster", "current": "tfnb.cluster",
    "ExposedServerWarning": "tfnb.cluster", "LoopbackGuard": "tfnb.cluster",
    "load_model": "tfnb.models", "Model": "tfnb.models", "LayerChain": "tfnb.models",
    "describe_model": "tfnb.models", "describe_cluster": "tfnb.placement",
    "place": "tfnb.placement", "PlacedModel": "tfnb.runtime", "ReplicatedModel": "tfnb.runtime",
    "ReplicaLostWarning": "tfnb.runtime", "ReplicaRestoredWarning": "tfnb.runtime",
    "serve": "tfnb.serving", "Server": "tfnb.serving",
    "profile": "tfnb.profiler", "Profile": "tfnb.profiler",
    "PlacementEditor": "tfnb.notebook.widgets",
    "serving_view": "tfnb.notebook.widgets.serving_view",
    "plan": "tfnb.placement", "Plan": "tfnb.placement", "Topology": "tfnb.placement",
}


def __getattr__(name):
    if name in ("cluster", "models", "runtime", "placement", "profiler", "notebook", "serving"):
        import importlib

        return importlib.import_module(f"tfnb.{name}")
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfnb' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


def load_ipython_extension(ipython):
    """``%load_ext tfnb``: register ``%tfcluster``, ``%%tfprofile``, ``%tfplace`` and ``%tfserve``
    (:mod:`tfnb.notebook.magics`)."""
    from tfnb.notebook.magics import load_ipython_extension as _load

    _load(ipython)


__all__ = ["TfnbError", "__version__", *_LAZY]
