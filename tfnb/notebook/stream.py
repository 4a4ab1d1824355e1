"""Live text generation: the text so far, the token count and tokens/s.

``%load_ext tfnb`` installs :class:`LiveText` as the runtime's display hook, so
``placed.generate(...)`` and ``placed.chat(...)`` show their text as chunks of tokens arrive;
the call still returns the text. In a Jupyter kernel that is one output area per call, updated
in place; in terminal IPython the text is printed as it comes, then one line with the token
count and tokens/s. A script prints nothing unless it asks for the view with
``on_chunk=LiveText()`` (nothing installs the hook in plain Python).
"""
from __future__ import annotations

import html
import sys

from IPython.display import HTML, display

from tfnb import hooks
from tfnb.notebook import in_kernel


class LiveText:
    """An ``on_chunk`` callback that shows a generate call live.

    Parameters
    ----------
    file : file-like, optional
        Where the text goes outside a kernel (default: ``sys.stdout`` at each chunk).
    html : bool, optional
        Draw HTML in a display area (default: only in a Jupyter kernel) or print text.

    Examples
    --------
    >>> placed.chat("Hello", on_chunk=LiveText())        # doctest: +SKIP
    Hello! How can I help you today?
    [9 tokens, 31.0 tokens/s]
    """

    def __init__(self, file=None, *, html: bool | None = None):
        self.html = in_kernel() if html is None else bool(html)
        self.file = file
        self.handle = None
        self.last = ""     # what was drawn last (HTML), or printed so far (text)

    def render(self, event) -> str:
        """The chunk ``event`` as HTML: the count, tokens/s, state and the text so far."""
        texts = event.new_text or []
        body = texts[0] if len(texts) == 1 else "\n---\n".join(texts)
        state = "done" if event.finished else "generating"
        return (f'<div class="tfnb-live"><small>{event.n_tokens} tokens · '
                f"{event.tokens_per_s:.1f} tokens/s · {state}</small>"
                f'<pre style="white-space:pre-wrap;margin:0">{html.escape(body)}</pre></div>')

    def __call__(self, event) -> None:
        if not self.html:
            self._print(event)
            return
        self.last = self.render(event)
        if self.handle is None:
            self.handle = display(HTML(self.last), display_id=True)
        else:
            self.handle.update(HTML(self.last))

    def _print(self, event) -> None:
        """Text mode: one prompt's new text as it comes (several prompts' texts at the end),
        then ``[n tokens, x tokens/s]``. Printed text cannot be taken back, so a character
        still being decoded waits for the next chunk."""
        out = self.file or sys.stdout
        texts = event.new_text or []
        new = ""
        if len(texts) == 1 and texts[0].startswith(self.last):
            new = texts[0][len(self.last):]
            if not event.finished:
                new = new.rstrip("\ufffd")
        elif len(texts) > 1 and event.finished:
            new = "\n---\n".join(texts)
        self.last += new
        out.write(new)
        if event.finished:
            end = "" if not self.last or self.last.endswith("\n") else "\n"
            out.write(f"{end}[{event.n_tokens} tokens, {event.tokens_per_s:.1f} tokens/s]\n")
        out.flush()


def enable(ipython) -> bool:
    """Install the live display for generate calls made from ``ipython``: HTML in a Jupyter
    kernel, text in terminal IPython. Returns whether it was installed.

    Examples
    --------
    >>> enable(get_ipython())                           # doctest: +SKIP
    True
    """
    if ipython is None:
        return False
    hooks.display_hook = LiveText
    return True
