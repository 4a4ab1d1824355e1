"""A model as a chain of stages, with the numbers a placement needs (no TensorFlow devices here).

Cost model (kept deliberately simple; activations float32, batch 1, per token):

- ``param_bytes``: bytes of the parameters the stage needs on its device: 4 per parameter, or
  their packed size for packed GGUF weights (:func:`llama_chain`). With tied embeddings the head
  stage needs the embedding matrix too, so it is counted in *both* ``embed`` and ``head``: two
  devices hold a copy. ``LayerChain.total_param_bytes`` sums stages (copies included);
  ``LayerChain.unique_param_bytes`` counts each weight once.
- ``flops_per_token``: 2 x the matmul parameters (one multiply-add each). Norms, activations,
  rotary and softmax are O(hidden) and ignored. The embedding lookup costs 0.
- ``attn_flops_per_context``: attention's extra cost per token per token of context
  (QK^T and AV: 2 x 2 x n_heads x head_dim); ``Stage.flops(context_len)`` adds it.
- ``act_bytes_out_per_token``: bytes leaving the stage per token: hidden x 4 for embed and blocks.
  The head's output is the logits, vocab x 4; that crosses the network only if the logits go back
  to the client (a runtime that samples next to the head sends 4 bytes, one id, instead).
- ``kv_bytes_per_token``: KV cache per token of context: 2 x n_kv_heads x head_dim x 4 per block.

For opaque HF ("hf") and Keras ("keras") models the numbers come from the Keras variables:
``param_bytes`` = 4 bytes x their element count, FLOPs = 2 x the elements of weights with two or
more dimensions (dense-like layers; embeddings are lookups and cost 0).
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from tfnb.errors import ModelError
from tfnb.models.decoder import weight_shapes
from tfnb.models.packed import weight_nbytes
from tfnb.names import format_bytes, format_count, format_span, short_device

__all__ = ["Stage", "LayerChain", "llama_chain", "variables_chain", "keras_chain", "STAGE_KINDS",
           "block_stage", "block_index", "is_block", "stage_names", "Segment", "segments"]

STAGE_KINDS = ("embed", "block", "head", "layer")
_F32 = 4
_BLOCK_STAGE = re.compile(r"block\.(\d+)")


def block_stage(i: int) -> str:
    """The name of transformer block ``i``'s stage; ``block_index`` reads it back.

    Examples
    --------
    >>> block_stage(3)
    'block.3'
    """
    if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0:
        raise ModelError(f"block index {i!r}: expected a non-negative integer")
    return f"block.{int(i)}"


def block_index(stage: str) -> int | None:
    """The block number in a stage name made by ``block_stage``; ``None`` for other stages.

    Examples
    --------
    >>> block_index("block.12"), block_index("head")
    (12, None)
    """
    match = _BLOCK_STAGE.fullmatch(stage) if isinstance(stage, str) else None
    return int(match.group(1)) if match else None


def is_block(stage: str) -> bool:
    """Whether ``stage`` names a transformer block (``"block.{i}"``).

    Examples
    --------
    >>> is_block("block.0"), is_block("embed")
    (True, False)
    """
    return block_index(stage) is not None


def stage_names(n_blocks: int) -> list[str]:
    """``["embed", "block.0", ..., "block.{n_blocks-1}", "head"]``: a decoder's stages in order.

    Examples
    --------
    >>> stage_names(2)
    ['embed', 'block.0', 'block.1', 'head']
    """
    return ["embed"] + [block_stage(i) for i in range(n_blocks)] + ["head"]


@dataclass(frozen=True)
class Segment:
    """A run of consecutive stages on one device: what a plan shows and the runtime compiles.

    Examples
    --------
    >>> seg = Segment("/job:worker/replica:0/task:1/device:CPU:0", ("block.1", "head"))
    >>> seg, seg.blocks, seg.has_head
    (Segment(worker:1/CPU:0: block.1 .. head (2)), (1,), True)
    """

    device: str
    stages: tuple[str, ...]

    @property
    def blocks(self) -> tuple[int, ...]:
        """The transformer blocks among the stages, in order."""
        return tuple(i for i in map(block_index, self.stages) if i is not None)

    @property
    def has_embed(self) -> bool:
        return "embed" in self.stages

    @property
    def has_head(self) -> bool:
        return "head" in self.stages

    def __repr__(self) -> str:
        return f"Segment({short_device(self.device)}: {format_span(self.stages)})"


def segments(assignment: dict[str, str], names=None) -> list[Segment]:
    """The segments of ``assignment`` (stage -> device), over ``names`` in order (default: the
    assignment's own order).

    Examples
    --------
    >>> segments({"embed": "a", "block.0": "a", "block.1": "b", "head": "b"})
    [Segment(a: embed .. block.0 (2)), Segment(b: block.1 .. head (2))]
    """
    runs: list[list[str]] = []
    for name in (list(assignment) if names is None else names):
        if runs and assignment[runs[-1][-1]] == assignment[name]:
            runs[-1].append(name)
        else:
            runs.append([name])
    return [Segment(assignment[r[0]], tuple(r)) for r in runs]


@dataclass(frozen=True)
class Stage:
    """One unit of placement: a name, its kind and its costs per token.

    Examples
    --------
    >>> s = Stage("block.0", "block", 1000, 500, 256, 128, ("blocks.0.wq",), 64)
    >>> s.flops(context_len=10)
    1140
    """

    name: str
    kind: str
    param_bytes: int
    flops_per_token: int
    act_bytes_out_per_token: int
    kv_bytes_per_token: int
    weight_names: tuple[str, ...] = field(default=(), repr=False)
    attn_flops_per_context: int = 0

    def __post_init__(self):
        if self.kind not in STAGE_KINDS:
            raise ModelError(f"Stage kind {self.kind!r}: expected one of {list(STAGE_KINDS)}")
        object.__setattr__(self, "weight_names", tuple(self.weight_names))

    def flops(self, context_len: int = 0) -> int:
        """FLOPs for one new token attending to ``context_len`` earlier tokens."""
        return int(self.flops_per_token + self.attn_flops_per_context * context_len)

    def to_row(self) -> dict:
        """The stage as a flat dict (``weight_names`` as a count)."""
        return {"name": self.name, "kind": self.kind, "param_bytes": self.param_bytes,
                "flops_per_token": self.flops_per_token,
                "attn_flops_per_context": self.attn_flops_per_context,
                "act_bytes_out_per_token": self.act_bytes_out_per_token,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "n_weights": len(self.weight_names)}


class LayerChain:
    """An ordered, read-only sequence of ``Stage`` objects, indexable by position or name.

    Examples
    --------
    >>> from tfnb.models.decoder import tiny_config
    >>> chain = llama_chain(tiny_config())
    >>> len(chain), chain[0].name, chain["head"].kind
    (4, 'embed', 'head')
    >>> chain.kv_bytes(batch=1, context_len=10)["block.0"]   # 10 tokens x 256 bytes
    2560
    """

    def __init__(self, stages, weight_bytes: dict[str, int] | None = None):
        self._stages = tuple(stages)
        self._by_name = {s.name: s for s in self._stages}
        if len(self._by_name) != len(self._stages):
            raise ModelError(f"stage names {[s.name for s in self._stages]} repeat: "
                             "expected unique names")
        self._weight_bytes = dict(weight_bytes or {})

    def __len__(self) -> int:
        return len(self._stages)

    def __iter__(self) -> Iterator[Stage]:
        return iter(self._stages)

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self._by_name:
                raise ModelError(f"no stage {key!r}: expected one of {self.names[:3]} ... "
                                 f"{self.names[-1]}")
            return self._by_name[key]
        if isinstance(key, slice):
            return LayerChain(self._stages[key], self._weight_bytes)
        return self._stages[key]

    def __contains__(self, key) -> bool:
        return key in self._by_name if isinstance(key, str) else key in self._stages

    @property
    def names(self) -> list[str]:
        """Stage names in order."""
        return [s.name for s in self._stages]

    @property
    def total_param_bytes(self) -> int:
        """Sum of the stages' ``param_bytes`` (a tied embedding counts in embed and head)."""
        return sum(s.param_bytes for s in self._stages)

    @property
    def unique_param_bytes(self) -> int:
        """Bytes of the distinct weights (each tied weight counted once)."""
        if not self._weight_bytes:
            return self.total_param_bytes
        names = {n for s in self._stages for n in s.weight_names}
        return sum(self._weight_bytes[n] for n in names)

    def flops_per_token(self, context_len: int = 0) -> int:
        """Total FLOPs for one token at ``context_len``."""
        return sum(s.flops(context_len) for s in self._stages)

    def kv_bytes(self, batch: int, context_len: int) -> dict[str, int]:
        """KV-cache bytes per stage for ``batch`` sequences of ``context_len`` tokens."""
        for arg, value in (("batch", batch), ("context_len", context_len)):
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ModelError(f"{arg}={value!r}: expected a non-negative integer")
        return {s.name: int(s.kv_bytes_per_token * batch * context_len) for s in self._stages}

    def to_rows(self) -> list[dict]:
        """One dict per stage (see ``Stage.to_row``)."""
        return [s.to_row() for s in self._stages]

    def _summary_rows(self) -> list[tuple[str, ...]]:
        """Rows for the table views; a run of identical blocks is folded into one line."""
        rows, i = [], 0
        while i < len(self._stages):
            s, j = self._stages[i], i
            while (j + 1 < len(self._stages) and self._stages[j + 1].kind == s.kind == "block"
                   and self._stages[j + 1].param_bytes == s.param_bytes):
                j += 1
            name = s.name if j == i else f"{s.name} .. {self._stages[j].name}"
            each = " each" if j > i else ""
            rows.append((name, s.kind, format_bytes(s.param_bytes, "MB", 2) + each,
                         format_count(s.flops_per_token),
                         f"{s.act_bytes_out_per_token:,} B", f"{s.kv_bytes_per_token:,} B"))
            i = j + 1
        return rows

    _HEADER = ("stage", "kind", "params", "FLOP/token", "act out/token", "KV/token")

    def __str__(self) -> str:
        rows = [self._HEADER] + self._summary_rows()
        widths = [max(len(r[c]) for r in rows) for c in range(len(self._HEADER))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.append(self._total_line())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"LayerChain({len(self)} stages: {', '.join(self.names[:2])}"
                f"{', ...' if len(self) > 3 else ''}"
                f"{', ' + self.names[-1] if len(self) > 2 else ''};"
                f" {format_bytes(self.total_param_bytes, 'MB', 2)})")

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self._HEADER)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in self._summary_rows())
        return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"<p>{html.escape(self._total_line())}</p>")

    def _total_line(self) -> str:
        return (f"{len(self)} stages, {format_bytes(self.total_param_bytes, 'MB', 2)} in stages "
                f"({format_bytes(self.unique_param_bytes, 'MB', 2)} unique)")


def llama_chain(config, weights: dict | None = None, nbytes: dict | None = None) -> LayerChain:
    """Stages ``embed``, ``block.0`` ... ``block.{n-1}``, ``head`` of a llama config.

    Bytes are float32 sizes, or those of ``weights`` as the devices will hold them (packed
    GGUF blocks count their packed bytes), or ``nbytes`` (canonical name -> bytes) for a model
    described without its weights (:func:`tfnb.models.describe.describe_model`).

    Examples
    --------
    >>> from tfnb.models.decoder import tiny_config
    >>> llama_chain(tiny_config())["block.1"].kv_bytes_per_token   # 2 x 2 kv heads x 16 x 4
    256
    """
    shapes = weight_shapes(config)
    if weights is not None:
        nbytes = {n: weight_nbytes(weights[n]) for n in shapes}
    elif nbytes is not None:
        nbytes = {n: int(nbytes[n]) for n in shapes}
    else:
        nbytes = {n: int(np.prod(s)) * _F32 for n, s in shapes.items()}
    d, hd = config.hidden_size, config.head_dim

    def matmul_flops(names):
        return sum(2 * int(np.prod(shapes[n])) for n in names if len(shapes[n]) == 2)

    stages = [Stage("embed", "embed", nbytes["embed"], 0, d * _F32, 0, ("embed",))]
    for i in range(config.n_layers):
        names = tuple(n for n in shapes if n.startswith(f"blocks.{i}."))
        stages.append(Stage(
            block_stage(i), "block", sum(nbytes[n] for n in names), matmul_flops(names),
            d * _F32, 2 * config.n_kv_heads * hd * _F32, names,
            attn_flops_per_context=4 * config.n_heads * hd))
    # Tied: the head multiplies by embed.T, so its device needs (and is charged for) embed as well.
    head_names = ("final_norm", "embed") if config.tie_embeddings else ("final_norm", "lm_head")
    head_flops = 2 * d * config.vocab_size
    stages.append(Stage("head", "head", sum(nbytes[n] for n in head_names), head_flops,
                        config.vocab_size * _F32, 0, head_names))
    return LayerChain(stages, nbytes)


_BLOCK_RE = re.compile(r"^[^/]+/[^/]+/([A-Za-z_]+?)(?:_\._|\.)(\d+)/")


def _var_flops(shape) -> int:
    """2 x elements of a weight matrix; vectors and (1, n) biases cost nothing."""
    return 2 * int(np.prod(shape)) if len(shape) >= 2 and shape[0] > 1 else 0


def variables_chain(hf_model, *, tied_names: tuple[str, ...] = (), kv_bytes_per_token: int = 0,
                    act_bytes: int = 0, out_bytes: int = 0, attn_flops: int = 0) -> LayerChain:
    """Chain of an HF TF model from its variable names: ``embed``, ``block.i``, ``head``.

    Variables under ``<model>/<main>/<name>.<i>/`` (or ``<name>_._<i>``) form block ``i``; those
    before the first block form ``embed``, the rest ``head``. ``tied_names`` (the input embedding
    of a tied model) are added to ``head`` too. Embedding FLOPs are 0; others 2 x matrix sizes.

    Examples
    --------
    >>> chain = variables_chain(gpt2_model)  # doctest: +SKIP
    >>> chain.names  # doctest: +SKIP
    ['embed', 'block.0', 'block.1', 'head']
    """
    groups: dict[str, list] = {"embed": []}
    block_order: list[str] = []
    seen_block = False
    for var in hf_model.weights:
        match = _BLOCK_RE.match(var.name)
        if match:
            key = block_stage(int(match.group(2)))
            if key not in groups:
                groups[key] = []
                block_order.append(key)
            seen_block = True
        else:
            key = "head" if seen_block else "embed"
        groups.setdefault(key, []).append(var)
    if not block_order:
        raise ModelError(f"model {type(hf_model).__name__} has no numbered blocks in its "
                         "variable names: expected a transformer with <name>.<i> blocks")
    by_name = {v.name: v for v in hf_model.weights}
    head = list(groups.get("head", []))
    head_names = {v.name for v in head}
    head += [by_name[n] for n in tied_names if n in by_name and n not in head_names]
    nbytes = {v.name: int(np.prod(v.shape)) * _F32 for v in hf_model.weights}

    def stage(name, kind, vars_, flops, out, kv=0, attn=0):
        names = tuple(v.name for v in vars_)
        return Stage(name, kind, sum(nbytes[n] for n in names), flops, out, kv, names, attn)

    stages = [stage("embed", "embed", groups["embed"], 0, act_bytes)]
    for key in block_order:
        vars_ = groups[key]
        stages.append(stage(key, "block", vars_, sum(_var_flops(v.shape) for v in vars_),
                            act_bytes, kv_bytes_per_token, attn_flops))
    head_flops = sum(_var_flops(v.shape) for v in head)
    stages.append(stage("head", "head", head, head_flops, out_bytes))
    return LayerChain(stages, nbytes)


def keras_chain(keras_model) -> LayerChain:
    """One ``layer`` stage per top-level Keras layer (input layers skipped).

    ``act_bytes_out_per_token`` is 4 x the output elements per sample; for outputs of rank 3 or
    more the second axis is taken as the token axis and excluded.

    Examples
    --------
    >>> keras_chain(model).names  # doctest: +SKIP
    ['dense', 'dense_1']
    """
    stages, nbytes = [], {}
    for layer in keras_model.layers:
        if type(layer).__name__ == "InputLayer":
            continue
        names = []
        for var in layer.weights:
            vname = getattr(var, "path", None) or var.name
            nbytes[vname] = int(np.prod(var.shape)) * _F32
            names.append(vname)
        try:
            shape = tuple(layer.output.shape)
            per = shape[2:] if len(shape) >= 3 else shape[1:]
            out = int(np.prod([d or 1 for d in per])) * _F32
        except (AttributeError, ValueError, TypeError):
            out = 0
        flops = sum(_var_flops(v.shape) for v in layer.weights
                    if "embedding" not in type(layer).__name__.lower())
        stages.append(Stage(layer.name, "layer", sum(nbytes[n] for n in names), flops, out, 0,
                            tuple(names)))
    if not stages:
        raise ModelError(f"Keras model {keras_model.name!r} has no layers: expected at least one")
    return LayerChain(stages, nbytes)
