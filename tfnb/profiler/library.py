"""Which input of a traced node a transferred tensor is: read from the client's function library.

A worker runs the *partitioned, lowered* graph of a ``tf.function``, so the node names in its
trace are not always those of the FunctionDef the client registered (TF 2.21):

* a ``tf.while_loop``'s body and condition are separate functions (``while_body_645``) that the
  runtime inlines with a prefix: body node ``while/StatefulPartitionedCall_1`` of the ``While``
  node ``while`` runs as ``while/body/_1/while/StatefulPartitionedCall_1``; ``tf.cond`` branches
  likewise as ``<if>/then/_N/...`` and ``<if>/else/_N/...``, inlined calls as ``<call>/_N/...``;
* an XLA-compiled call (``jit_compile=True``) stays one ``StatefulPartitionedCall`` node whose
  traced ``shape`` stat lists every input (resource handles print as empty entries).

:class:`Library` maps such a name back to ``(function, node)`` by following the ``body`` /
``cond`` / ``then_branch`` / ``else_branch`` / ``f`` attribute of the node before each inlining
marker, and answers which data input of the consumer comes from the producer.
"""
from __future__ import annotations

import re

_INLINED = re.compile(r"/(?:(body|cond|then|else)/)?_\d+/")
_ATTR = {"body": "body", "cond": "cond", "then": "then_branch", "else": "else_branch", None: "f"}


def strip_inlined(node: str) -> str:
    """The node's name inside the innermost inlined function: ``while/body/_1/a/b`` -> ``a/b``."""
    matches = list(_INLINED.finditer(node))
    return node[matches[-1].end():] if matches else node


def _data_indices(node_def, producer: str) -> set[int]:
    data = [i for i in node_def.input if not i.startswith("^")]
    return {k for k, i in enumerate(data) if i.split(":")[0] == producer}


class Library:
    """FunctionDefs of this process's eager context, loaded on first use and kept for one build.

    ``defs`` (``{name: FunctionDef}``) can be given directly (tests, saved profiles).
    """

    def __init__(self, defs: dict | None = None):
        self._defs = dict(defs) if defs is not None else None
        self._ctx = None
        self._nodes: dict = {}
        self._all_loaded = defs is not None

    def _context(self):
        if self._ctx is None:
            from tensorflow.python.eager import context

            self._ctx = context.context()
        return self._ctx

    def fdef(self, name: str | None):
        if not name:
            return None
        if self._defs is None:
            self._defs = {}
        if name not in self._defs and not self._all_loaded:
            try:
                self._defs[name] = self._context().get_function_def(name)
            except Exception:  # noqa: BLE001 - unknown here (another client's function)
                self._defs[name] = None
        return self._defs.get(name)

    def all_names(self) -> list[str]:
        if not self._all_loaded:
            try:
                for n in self._context().list_function_names():
                    self.fdef(n)
            except Exception:  # noqa: BLE001 - no TF context: nothing to search
                pass
            self._all_loaded = True
        return [n for n, f in (self._defs or {}).items() if f is not None]

    def nodes(self, function: str) -> dict:
        if function not in self._nodes:
            fd = self.fdef(function)
            self._nodes[function] = {n.name: n for n in fd.node_def} if fd is not None else {}
        return self._nodes[function]

    def resolve(self, function: str | None, node: str, _depth: int = 0):
        """``(function, node_def)`` of a partitioned node name, starting at ``function``."""
        nodes = self.nodes(function) if function else {}
        if node in nodes:
            return function, nodes[node]
        if _depth > 8:
            return None
        for m in _INLINED.finditer(node):
            owner = nodes.get(node[:m.start()])
            attr = owner.attr.get(_ATTR[m.group(1)]) if owner is not None else None
            if attr is not None and attr.func.name:
                found = self.resolve(attr.func.name, node[m.end():], _depth + 1)
                if found:
                    return found
        return None

    def input_index(self, function: str | None, producer: str, consumer: str) -> int | None:
        """Which data input of ``consumer`` comes from ``producer`` (partitioned names), or None
        unless exactly one answer is found. Looked up in ``function`` (the step's function)
        first, else in every function where the stripped names occur."""
        p, c = self.resolve(function, producer), self.resolve(function, consumer)
        if p and c and p[0] == c[0]:
            found = _data_indices(c[1], p[1].name)
            if len(found) == 1:
                return found.pop()
            if found:
                return None
        sp, sc = strip_inlined(producer), strip_inlined(consumer)
        found = set()
        for name in self.all_names():
            node = self.nodes(name).get(sc)
            if node is not None:
                found |= _data_indices(node, sp)
        return found.pop() if len(found) == 1 else None
