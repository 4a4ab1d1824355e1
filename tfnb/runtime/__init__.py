"""Placed llama inference: stages on TF devices, one graph call per generate (or chunk).

Examples
--------
>>> from tfnb.runtime import place                             # doctest: +SKIP
>>> pm = place(model, ["/device:CPU:0", "/device:CPU:1"])       # doctest: +SKIP
>>> pm.generate("Hello", max_new_tokens=16)                     # doctest: +SKIP
"""

from tfnb.runtime.devices import even_split, resolve_assignment, stage_names
from tfnb.runtime.placed import PlacedModel, Segment, place
from tfnb.runtime.session import ChunkEvent

__all__ = ["place", "PlacedModel", "Segment", "ChunkEvent", "stage_names", "even_split",
           "resolve_assignment"]
