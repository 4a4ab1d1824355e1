"""Outside a Jupyter kernel the live views print text: a plain script (only the views it asks
for) and a terminal IPython with ``%load_ext tfnb`` (generate shows its text as it comes), each
in a fresh process on this process's CPU with a tiny random model."""
import os
import re
import subprocess
import sys
from pathlib import Path

_PLACE = """
import tfnb
from tfnb.models import tiny
placed = tfnb.place(tiny("llama"), ["/device:CPU:0"])
placed.eos_ids = ()  # every call makes all its tokens
"""

_SCRIPT = _PLACE + """
from tfnb.notebook.stream import LiveText
quiet = placed.generate("hello", max_new_tokens=12)
pieces = list(placed.generate("hello", max_new_tokens=12, stream=True))
print("QUIET", len(quiet), len("".join(pieces)), flush=True)
shown = placed.generate("hello", max_new_tokens=24, chunk_tokens=8, on_chunk=LiveText())
print("RETURNED", repr(shown), flush=True)
view = tfnb.serving_view(placed, interval=0.05)
view.stop()
print("STOPPED", type(view).__name__, view.running, view.thread.is_alive(), flush=True)
"""

_IPYTHON = "%load_ext tfnb\n" + _PLACE + """
text = placed.generate("hello", max_new_tokens=24, chunk_tokens=8)
print("RETURNED", repr(text), flush=True)
view = tfnb.serving_view(placed, interval=0.05)
view.stop()
print("STOPPED", type(view).__name__, view.running, flush=True)
"""


def _run(cmd, tmp_path):
    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"), TF_CPP_MIN_LOG_LEVEL="3")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


def _returned(out: str) -> str:
    return eval(re.search(r"^RETURNED (.*)$", out, re.M).group(1))  # a repr of a str


def test_a_script_prints_only_the_views_it_asks_for(tmp_path):
    out = _run([sys.executable, "-c", _SCRIPT], tmp_path)
    assert out.startswith("QUIET 12 12\n")  # plain generate and stream=True print nothing
    text = _returned(out)
    assert f"QUIET 12 12\n{text}\n[24 tokens, " in out and " tokens/s]\nRETURNED" in out
    status = out.split("RETURNED", 1)[1]
    assert "0 request(s) in flight on 1 replica(s)" in status
    assert re.search(r"lane 0: 0/\d+ rows in use, 0 in flight", status)
    assert "STOPPED ServingText False False" in out


def test_terminal_ipython_with_the_extension_shows_generate_live(tmp_path):
    ipython = Path(sys.executable).with_name("ipython")
    out = _run([str(ipython), "--quick", "--no-banner", "--colors=nocolor",
                "--HistoryManager.enabled=False", "-c", _IPYTHON], tmp_path)
    text = _returned(out)
    assert f"{text}\n[24 tokens, " in out.split("RETURNED")[0]  # printed before it returned
    assert re.search(r"lane 0: 0/\d+ rows in use, 0 in flight", out)
    assert "STOPPED ServingText False" in out
