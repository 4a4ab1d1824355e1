"""Placed llama inference: stages on TF devices, decoded in chunks, one graph call per chunk.

- ``forward``: the model's math as pure TF functions; ``graphs``: the compiled-segment protocol
  (segments, their XLA functions, the prefill and decode graphs); ``wire``: one tensor each way
  per call;
- ``weights``: weights and KV caches as variables on the segments' devices; ``devices``:
  checking an assignment of stages to devices;
- ``requests`` and ``session``: checking a generate call, and the caller's side of it;
- ``scheduler``: continuous batching, requests sharing lanes of KV-cache rows;
- ``placed``: ``PlacedModel``, which ties them together; ``faults``: deadlines and liveness;
- ``replicas``: ``ReplicatedModel``, full copies on several devices, requests spread by load;
- ``calibrate``: stage times for the planners, with the same compiled functions;
- ``layers``: per-layer placement of a Keras chain of layers.

Examples
--------
>>> from tfnb.runtime import place_llama                       # doctest: +SKIP
>>> pm = place_llama(model, ["/device:CPU:0", "/device:CPU:1"]) # doctest: +SKIP
>>> pm.generate("Hello", max_new_tokens=16)                     # doctest: +SKIP
"""

from tfnb.models.chain import Segment
from tfnb.runtime.devices import even_split, resolve_assignment
from tfnb.runtime.placed import PlacedModel, place_llama
from tfnb.runtime.replicas import ReplicaLostWarning, ReplicaRestoredWarning, ReplicatedModel
from tfnb.runtime.requests import GenerateOptions, GenerateRequest
from tfnb.runtime.session import ChunkEvent

__all__ = ["place_llama", "PlacedModel", "ReplicatedModel", "ReplicaLostWarning",
           "ReplicaRestoredWarning", "Segment",
           "ChunkEvent", "GenerateOptions",
           "GenerateRequest", "even_split", "resolve_assignment"]
