"""Live generation display: the notebook layer's hook sees every chunk of a real generate."""
import html

import pytest

import tfnb
from tfnb import hooks
from tfnb.models import tiny


@pytest.fixture(scope="module")
def placed_tiny(local_workers):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = tfnb.connect(local_workers)
    return tfnb.place(tiny("llama"), cluster.devices, cluster)


def test_live_text_shows_text_count_and_speed(placed_tiny):
    from tfnb.notebook.stream import LiveText

    class Recording(LiveText):  # what the display area would show, chunk after chunk
        def __call__(self, event):
            self.shown = getattr(self, "shown", []) + [self.render(event)]

    live = Recording()
    text = placed_tiny.generate("hello", max_new_tokens=40, chunk_tokens=8, on_chunk=live)
    n = len(placed_tiny.generate_ids("hello", max_new_tokens=40))
    assert len(live.shown) == -(-n // 8)
    assert all("generating" in s for s in live.shown[:-1])
    assert all(w in live.shown[-1] for w in (f"{n} tokens", "tokens/s", "done"))
    assert html.escape(text) in live.shown[-1]


def test_no_hook_means_one_graph_call(placed_tiny):
    calls = []
    hooks.display_hook = None
    placed_tiny.generate("hello", max_new_tokens=24, on_chunk=None)
    assert placed_tiny.last_stats["chunks"] == 1
    hooks.display_hook = lambda: calls.append
    try:
        placed_tiny.generate("hello", max_new_tokens=24)
    finally:
        hooks.display_hook = None
    assert calls and calls[-1].finished and placed_tiny.last_stats["chunks"] == len(calls)


class Writes:
    """A file that keeps every write, to see text arrive piece by piece."""

    def __init__(self):
        self.writes = []

    def write(self, s):
        self.writes.append(s)

    def flush(self):
        pass


def test_outside_a_kernel_the_live_view_prints_text_as_it_comes_then_tokens_per_s(placed_tiny):
    from tfnb.notebook.stream import LiveText

    out = Writes()
    live = LiveText(file=out)
    assert not live.html  # pytest is no Jupyter kernel
    text = placed_tiny.generate("hello", max_new_tokens=40, chunk_tokens=8, on_chunk=live)
    n = placed_tiny.last_stats["tokens"]
    printed = "".join(out.writes)
    pieces = [w for w in out.writes if w and not w.startswith(("[", "\n["))]
    assert len(pieces) >= 2 and "".join(pieces) == text  # several chunks, each printed once
    assert printed.rstrip("\n").endswith(" tokens/s]")
    last = printed.rstrip("\n").rsplit("\n", 1)[-1]
    assert last.startswith(f"[{n} tokens, ") and float(last.split(", ")[1].split()[0]) > 0


def test_several_prompts_print_their_texts_once_at_the_end(placed_tiny):
    from tfnb.notebook.stream import LiveText

    out = Writes()
    texts = placed_tiny.generate(["hello", "the cat"], max_new_tokens=16, chunk_tokens=4,
                                 on_chunk=LiveText(file=out))
    printed = "".join(out.writes)
    assert printed.startswith("\n---\n".join(texts)) and printed.count("tokens/s]") == 1


def test_load_ext_in_terminal_ipython_installs_the_text_view(ipython):
    from tfnb.notebook.stream import LiveText, enable

    assert enable(ipython) and hooks.display_hook is LiveText
    assert not hooks.display_hook().html  # a terminal shell: text, not HTML
    assert not enable(None)
