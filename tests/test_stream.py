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
    assert f"{n} tokens" in live.shown[-1] and "tokens/s" in live.shown[-1] and "done" in live.shown[-1]
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
