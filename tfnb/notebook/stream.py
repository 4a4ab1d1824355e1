"""Live text generation in a notebook: the text so far, the token count and tokens/s.

``%load_ext tfnb`` in a Jupyter kernel installs :class:`LiveText` as the runtime's display hook,
so ``placed.generate(...)`` and ``placed.chat(...)`` update one output area per call as chunks of
tokens arrive; the call still returns the text.
"""
from __future__ import annotations

import html

from IPython.display import HTML, display

from tfnb import hooks


class LiveText:
    """An ``on_chunk`` callback that keeps one display area up to date.

    Examples
    --------
    >>> placed.chat("Hello", on_chunk=LiveText())        # doctest: +SKIP
    """

    def __init__(self):
        self.handle = None
        self.last = ""

    def render(self, event) -> str:
        texts = event.new_text or []
        body = texts[0] if len(texts) == 1 else "\n---\n".join(texts)
        state = "done" if event.finished else "generating"
        return (f'<div class="tfnb-live"><small>{event.n_tokens} tokens · '
                f"{event.tokens_per_s:.1f} tokens/s · {state}</small>"
                f'<pre style="white-space:pre-wrap;margin:0">{html.escape(body)}</pre></div>')

    def __call__(self, event) -> None:
        self.last = self.render(event)
        if self.handle is None:
            self.handle = display(HTML(self.last), display_id=True)
        else:
            self.handle.update(HTML(self.last))


def enable(ipython) -> bool:
    """Install the live display for generate calls when ``ipython`` is a Jupyter kernel."""
    if type(ipython).__name__ != "ZMQInteractiveShell":
        return False
    hooks.display_hook = LiveText
    return True
