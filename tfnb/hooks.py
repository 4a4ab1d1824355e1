"""Hooks the notebook layer installs into the core (the core never imports IPython itself).

``display_hook``: a factory of a live display for text generation, called once per generate or
chat call that has no ``on_chunk`` of its own. None in plain Python; ``%load_ext tfnb`` in a
Jupyter kernel sets it, so a notebook shows the text, the token count and tokens/s as chunks
of tokens arrive.
"""
display_hook = None
