"""Per-layer placement of a Keras model that is a chain of layers (``Model.arch == "keras"``).

Each layer is rebuilt from its config under ``tf.device`` of its stage, so its variables are
created on that device, and the client's weights are copied in once. The forward pass is one
``tf.function`` in which each layer runs on its device; only activations cross between devices.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfnb.errors import PlacementError
from tfnb.runtime.devices import resolve_assignment
from tfnb.runtime.faults import call_with_deadline
from tfnb.runtime.graphs import client_cpu


def _chain_layers(keras_model) -> list:
    return [layer for layer in keras_model.layers if type(layer).__name__ != "InputLayer"]


class PlacedLayers:
    """A Keras chain whose layers live on the devices of an assignment. Call it like the model.

    Examples
    --------
    >>> placed = tfnb.place(model, {"dense": dev0, "dense_1": dev1})   # doctest: +SKIP
    >>> placed(x).shape                                                # doctest: +SKIP
    """

    def __init__(self, model, assignment: dict[str, str], layers: list, *,
                 timeout: float | None = 60.0, plan=None):
        self.model = model
        self.assignment = assignment
        self.timeout, self.plan = timeout, plan
        self._layers = layers  # [(device, rebuilt layer)]
        self.lost: str | None = None
        self.devices = sorted(set(assignment.values()))
        self._forward = tf.function(self._run)

    def _run(self, x):
        for device, layer in self._layers:
            with tf.device(device):
                x = layer(x)
        return x

    @property
    def variables(self) -> list:
        """The placed ``tf.Variable``s (Keras 3 wraps each in a KerasVariable: unwrapped here)."""
        return [v if isinstance(v, tf.Variable) else v.value
                for _, layer in self._layers for v in layer.weights]

    def __call__(self, x) -> np.ndarray:
        if self.lost:
            raise PlacementError(f"{self.model.name} must be placed again: {self.lost}")
        with tf.device(client_cpu()):  # made here, not under a remote scope: see graphs.OnDevice
            x = tf.convert_to_tensor(x)
        return call_with_deadline(lambda: self._forward(x).numpy(), (), timeout=self.timeout,
                                  devices=self.devices, what=f"{self.model.name} forward pass")

    predict = __call__

    def on_state_lost(self, reason: str) -> None:
        """Called by the cluster when a worker holding our variables restarted or died."""
        self.lost = reason

    def __repr__(self) -> str:
        devices = sorted(set(self.assignment.values()))
        return (f"<PlacedLayers {self.model.name}: {len(self._layers)} layers on "
                f"{len(devices)} devices>")


def place_layers(model, assignment) -> PlacedLayers:
    """Rebuild each layer of ``model.keras_model`` on its device and check the result.

    The placed chain is run once on a random input and compared with the original model, so a
    model that is not a plain chain of layers (branches, skip connections) is refused instead of
    computing something else.
    """
    km = model.keras_model
    layers = _chain_layers(km)
    resolved = resolve_assignment(assignment, [layer.name for layer in layers])

    def rebuild(layer):
        with tf.device(client_cpu()):  # the values are made here: see graphs.OnDevice
            values = [tf.constant(w) for w in layer.get_weights()]
        with tf.device(resolved[layer.name]):
            clone = layer.__class__.from_config(layer.get_config())
            clone.build(tuple(layer.input.shape))
            for var, value in zip(clone.weights, values):
                var.assign(value)
        return resolved[layer.name], clone

    rebuilt = call_with_deadline(lambda: [rebuild(layer) for layer in layers], (), timeout=600.0,
                                 devices=sorted(set(resolved.values())),
                                 what=f"creating {model.name}'s layers")
    placed = PlacedLayers(model, resolved, rebuilt)
    shape = [2 if d is None else d for d in km.inputs[0].shape]
    probe_x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    want = np.asarray(km(probe_x))
    got = placed(probe_x)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise PlacementError(f"Keras model {km.name!r} is not a plain chain of layers (its layers "
                             "applied in order do not give its output); place a Sequential model "
                             "or a functional model without branches")
    return placed
