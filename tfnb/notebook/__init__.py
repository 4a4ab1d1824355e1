"""The notebook layer: magics, live views and widgets. tfnb's core never imports it.

A live view draws HTML in a Jupyter kernel and falls back to text elsewhere (terminal IPython,
scripts); :func:`in_kernel` is the one test of which.
"""
import sys

__all__ = ["in_kernel"]


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel, whose frontend shows HTML and widgets.

    False in terminal IPython and in plain Python, where live views print text instead.

    Examples
    --------
    >>> from tfnb.notebook import in_kernel
    >>> in_kernel()   # a doctest runs in plain Python
    False
    """
    ipython = sys.modules.get("IPython")  # not imported: not a kernel either
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None
