"""The quickstart as a person runs it: JupyterLab in a real browser (Debian's Chromium, Playwright).

The test starts JupyterLab on 127.0.0.1 (random token, free port) over a copy of notebooks/, opens
01-quickstart.ipynb, runs every cell above the last (``cluster.stop()``) from the Run menu, then
uses the placement widget as a user would: one range row per device (first and last stage), the
per-stage rows in a collapsed detail that it opens, then with the keyboard types a position
past the chain into the first worker's last-stage field (refused, one line) and steps it back
by one with ArrowDown (the second worker's first stage follows), checks the dataflow picture,
the figures and the detail rows, clicks Apply, reads the status line and the kernel's
``editor.placed``. It also checks the profile figure (``prof.plot("busy")``) is an
image. Screenshots go to ``artifacts/browser/`` (widget before and after Apply, the profile figure,
the whole page on failure).

Needs ``/usr/bin/chromium`` (Debian's ``chromium`` package; ``scripts/test`` installs it as root)
and the ``playwright`` package; Playwright never downloads a browser here.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts" / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NOTEBOOK = "01-quickstart.ipynb"
STARTUP_S = 120      # JupyterLab answering /api/status
RUN_S = 600          # every cell above the last (the quickstart takes 1-3 min on 2 cores)
APPLY_S = 180        # Apply moving one stage, and each single cell run after it

pytestmark = pytest.mark.slow


def _require_browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium package "
                    "(scripts/test does it when run as root)")
    try:
        import playwright.sync_api  # noqa: F401 - only checks that it is installed
    except ImportError:
        pytest.skip("the playwright package is missing: pip install -e '.[test]' "
                    "(bash scripts/setup)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


class Lab:
    """A JupyterLab server in its own session, with its own config, data and settings dirs."""

    def __init__(self, base: Path):
        self.base, self.port, self.token = base, _free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "jupyterlab.log"
        self.proc = None
        root, home = base / "notebooks", base / "home"
        shutil.copytree(ROOT / "notebooks", root)
        settings = home / "settings" / "@jupyterlab"
        # No news / update checks (no network here), and every cell attached to the page so that
        # clicks land where the layout says (the default windowing moves cells as they render).
        _write_json(settings / "apputils-extension" / "notification.jupyterlab-settings",
                    {"fetchNews": "false", "checkForUpdates": False})
        _write_json(settings / "notebook-extension" / "tracker.jupyterlab-settings",
                    {"windowingMode": "none"})
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"),
                   JUPYTER_DATA_DIR=str(home / "data"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
                   IPYTHONDIR=str(home / "ipython"), PYTHONUNBUFFERED="1")
        self.cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
                    f"--port={self.port}", "--port-retries=0",
                    f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
                    "--ServerApp.terminals_enabled=False", "--LabApp.extension_manager=readonly",
                    f"--LabApp.user_settings_dir={home / 'settings'}",
                    f"--LabApp.workspaces_dir={home / 'workspaces'}"]
        if os.geteuid() == 0:
            self.cmd.append("--allow-root")
        self.env, self.root = env, root

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.root, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"JupyterLab exited with {self.proc.returncode} while "
                                     f"starting:\n{self.log_tail()}")
            try:
                req = urllib.request.Request(f"{self.url}/api/status",
                                             headers={"Authorization": f"token {self.token}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"JupyterLab did not answer on {self.url} within {STARTUP_S} s:\n"
                             f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM (the server shuts its kernels down), then SIGKILL what is left, by pid."""
        if self.proc is None:
            return
        import psutil

        try:  # the kernels, and the TF workers they started
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        _, alive = psutil.wait_procs(family, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def _wait(what: str, timeout: float, check, seen=None, interval: float = 0.5):
    """Poll ``check()`` until it returns something truthy; it may raise AssertionError to fail.

    ``seen()``, when given, says what the page showed instead (for the timeout's message).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            shown = f"; the page shows {seen()!r}" if seen is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{shown}")
        time.sleep(interval)


# State of the code cells' prompts: "[*]:" queued or running, "[ ]:" not run, "[7]:" done.
PROMPTS_JS = ("nb => [...nb.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
              ".map(e => e.textContent.trim())")


def _spans(names, devices):
    """The dataflow picture's box labels for this assignment (runs of stages on one device)."""
    runs = []
    for name, dev in zip(names, devices):
        if runs and runs[-1][0] == dev:
            runs[-1][1].append(name)
        else:
            runs.append((dev, [name]))
    return [(s[0] if len(s) == 1 else f"{s[0]} .. {s[-1]} ({len(s)})") for _, s in runs]


def _range_fields(ranges) -> list[tuple[str, int, int]]:
    """Each range row as (device label, first position, last position), as its fields show."""
    return [(r[0], int(r[1]), int(r[2])) for r in ranges.evaluate_all(
        "rs => rs.map(r => [r.querySelector('.widget-html-content').textContent.trim(), "
        "...[...r.querySelectorAll('input')].map(i => i.value)])")]


def _spans_of(plan_text) -> list[str]:
    """The runs of the plan's table without their counts, e.g. ``embed .. block.16``."""
    return re.findall(r"(\S+ \.\. \S+) \(\d+\)", plan_text)


def _full_device(label: str) -> str:
    """The widget's short label ``worker:1/CPU:0`` as TensorFlow's full device name."""
    job, task, dev = re.fullmatch(r"([^:/]+):(\d+)/(.+)", label).groups()
    return f"/job:{job}/replica:0/task:{task}/device:{dev}"


@pytest.mark.timeout(1200)
def test_quickstart_in_jupyterlab(tmp_path, capsys):
    _require_browser()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("*.png"):
        old.unlink()
    shots: list[Path] = []
    lab = Lab(tmp_path)
    try:
        lab.start()
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1400})
                page.set_default_timeout(60_000)
                try:
                    _drive(page, lab, shots)
                except BaseException:
                    shot = ARTIFACTS / "failure-page.png"
                    try:
                        page.screenshot(path=shot)
                        shots.append(shot)
                    except Exception:  # noqa: BLE001 - the original error matters more
                        pass
                    raise
            finally:
                browser.close()
    except BaseException:
        print(f"--- JupyterLab log (last lines) ---\n{lab.log_tail()}")
        raise
    finally:
        lab.stop()
        with capsys.disabled():
            print(f"\nbrowser test screenshots in {ARTIFACTS}: "
                  f"{', '.join(p.name for p in shots) or 'none'}")


def _drive(page, lab, shots):
    page.goto(f"{lab.url}/lab/tree/{NOTEBOOK}?token={lab.token}", timeout=120_000)
    nb = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
    nb.locator(".jp-Cell").first.wait_for(timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    cells_in_file = json.loads((lab.root / NOTEBOOK).read_text())["cells"]
    n_code = sum(c["cell_type"] == "code" for c in cells_in_file)
    last = nb.locator(".jp-CodeCell").last
    _wait(f"all {n_code} code cells to be drawn", 60,
          lambda: nb.locator(".jp-CodeCell").count() == n_code
          and "cluster.stop()" in last.inner_text())

    # Select the last cell, then Run > Run All Above Selected Cell: everything but cluster.stop().
    _select(page, last)
    _menu(page, "Run", "notebook:run-all-above")
    _wait("the cells to be queued", 60, lambda: "[*]:" in nb.evaluate(PROMPTS_JS))

    def run_state():
        prompts = nb.evaluate(PROMPTS_JS)
        if "[*]:" in prompts:
            return None
        if not all(re.fullmatch(r"\[\d+\]:", p) for p in prompts[:-1]):
            errors = [t for t in nb.locator(".jp-OutputArea-output").all_inner_texts()
                      if "Traceback" in t or "Error" in t]
            raise AssertionError(f"the notebook stopped before the end: prompts {prompts}; "
                                 f"errors: {errors[-1:]}")
        return prompts

    prompts = _wait(f"the {n_code - 1} cells above the last to run", RUN_S, run_state,
                    lambda: nb.evaluate(PROMPTS_JS), 2.0)
    assert prompts[-1] == "[ ]:", f"cluster.stop() ran too early: {prompts}"
    tracebacks = [t for t in nb.locator(".jp-OutputArea-output").all_inner_texts()
                  if "Traceback (most recent call last)" in t]
    assert not tracebacks, tracebacks[0][-2000:]

    # The number of stages, as the plan shows it: one box per run of stages, "(N)" stages each.
    plan_cell = nb.locator(".jp-CodeCell").filter(has_text="tfnb.plan(model")
    plan_text = plan_cell.locator(".jp-OutputArea-output").inner_text()
    runs = [int(n) for n in re.findall(r"\.\. \S+ \((\d+)\)", plan_text)]
    assert len(runs) == 2, f"the plan splits the model over both workers: {plan_text[:600]}"
    n_stages = sum(runs)

    # The widget rendered (not "Loading widget..."): one range row per device, in pipeline order.
    widget = nb.locator(".jp-OutputArea-output").filter(
        has=page.locator("h4", has_text="Placement of"))
    widget.locator(".jupyter-widgets").first.wait_for()
    assert "Loading widget" not in nb.inner_text()
    header = widget.locator("h4").inner_text()
    assert f"{n_stages} stages" in header, (header, n_stages)
    ranges = widget.locator(".tfnb-range")
    assert ranges.count() == 2, ranges.all_inner_texts()
    shown = _range_fields(ranges)
    assert [r[1:] for r in shown] == [(0, runs[0] - 1), (runs[0], n_stages - 1)], shown
    summaries = [t.strip() for t in ranges.locator(".widget-html-content").all_inner_texts()[1::2]]
    assert [s.split(" (")[0] for s in summaries] == _spans_of(plan_text), (summaries, plan_text)
    apply = widget.locator("button", has_text="Apply")
    # The status line beside Apply (the line under it, Apply's disabled reason, is another span).
    status = widget.locator(".widget-hbox").filter(
        has=page.locator("button", has_text="Apply")).locator(
        ".tfnb-status, .tfnb-status-error")
    assert status.inner_text().startswith("applied"), status.inner_text()  # the notebook's apply()

    # The per-stage rows are a collapsed detail, made when opened: open it, one row per stage.
    rows = widget.locator(".tfnb-row")
    assert rows.count() == 0, "the per-stage detail is made before it is opened"
    widget.locator(".jupyter-widget-Collapse-header", has_text="per-stage detail").click()
    _wait(f"the per-stage detail to show {n_stages} rows", 60, lambda: rows.count() == n_stages,
          lambda: rows.count())
    assert widget.locator(".tfnb-row select").count() == n_stages
    heights = rows.evaluate_all("rs => rs.map(r => [r.getBoundingClientRect().height, "
                                "r.querySelector('select').getBoundingClientRect().height])")
    squashed = [i for i, (row, pick) in enumerate(heights) if row < pick]
    assert not squashed, f"rows {squashed} are lower than their dropdowns: {heights[:3]}"
    names = [t.strip() for t in rows.locator(".widget-html-content").all_inner_texts()]
    devices = rows.locator("select").evaluate_all("ss => ss.map(s => s.value)")
    assert len(names) == len(devices) == n_stages and len(set(devices)) == 2, devices
    k = devices.index(devices[-1])           # first stage on the second device
    assert k == runs[0] and devices[0] == shown[0][0], (devices, shown)  # short labels
    _shot(widget, "widget-before-apply.png", shots)

    # With the keyboard, in the first device's last-stage field: a position past the chain is
    # refused in one line and the field goes back; then ArrowDown moves the split up by one
    # stage: the second device's first stage follows, and the picture, the figures and the
    # detail rows update.
    moved, target = names[k - 1], devices[k]
    figures = widget.locator(".tfnb-figures")
    figures_before = figures.inner_text()
    last_field = ranges.nth(0).locator("input").nth(1)
    last_field.focus()
    page.keyboard.press("Control+A")
    page.keyboard.type("999")
    page.keyboard.press("Enter")
    _wait("the widget to refuse position 999", 60,
          lambda: "last=999: expected" in status.inner_text() and
          last_field.input_value() == str(k - 1), lambda: (status.inner_text(),
                                                           last_field.input_value()))
    assert "tfnb-status-error" in status.get_attribute("class")
    page.keyboard.press("ArrowDown")
    want_spans = _spans(names, devices[:k - 1] + [target] * (n_stages - k + 1))
    svg_spans = widget.locator("svg.tfnb-dataflow g.tfnb-segment text:first-of-type")
    _wait(f"the dataflow picture to show {want_spans}", 120,
          lambda: svg_spans.all_text_contents() == want_spans,
          lambda: (svg_spans.all_text_contents(), status.inner_text()))
    _wait("the range rows to show the new boundary", 60,
          lambda: [r[1:] for r in _range_fields(ranges)] == [(0, k - 2), (k - 1, n_stages - 1)],
          lambda: (_range_fields(ranges), status.inner_text()))
    _wait("the detail row to show the moved stage's new device", 60,
          lambda: rows.nth(k - 1).locator("select").input_value() == target,
          lambda: rows.nth(k - 1).locator("select").input_value())
    _wait("the predicted figures to change", 60, lambda: figures.inner_text() != figures_before)
    assert status.inner_text() == f"{shown[0][0]} runs {names[0]} .. {names[k - 2]}", \
        status.inner_text()
    assert apply.is_enabled(), widget.inner_text()[-800:]
    apply.click()

    def applied():
        text = status.inner_text()
        if "tfnb-status-error" in (status.get_attribute("class") or ""):
            raise AssertionError(f"Apply failed in the widget: {text}")
        return text if text.startswith("applied in") and "moving 1 stage(s)" in text else None

    status_text = _wait("the widget's status to say the stage moved", APPLY_S, applied,
                        lambda: status.inner_text())
    assert rows.nth(k - 1).locator("select").input_value() == target
    assert svg_spans.all_text_contents() == want_spans
    assert not widget.locator(".tfnb-status-error").count(), widget.inner_text()[-800:]
    rows.nth(k - 1).evaluate("r => r.scrollIntoView({block: 'center'})")  # where colours change
    _shot(widget, "widget-after-apply.png", shots)

    # The kernel holds the new placement: a new cell above cluster.stop() asks the editor.
    _select(page, last)
    page.keyboard.press("a")                        # insert a cell above (command mode)
    check = nb.locator(".jp-CodeCell").nth(n_code - 1)
    _wait("a new empty cell above cluster.stop()", 30,
          lambda: nb.locator(".jp-CodeCell").count() == n_code + 1
          and check.locator(".cm-content").inner_text().strip() == "",
          lambda: (nb.locator(".jp-CodeCell").count(), check.inner_text()))
    check.locator(".jp-InputArea-editor").click()
    code = f"editor.placed.plan.assignment[{moved!r}], editor.placed is placed"
    page.keyboard.type(code)
    assert check.locator(".cm-content").inner_text().strip() == code   # typed as is
    _menu(page, "Run", "notebook:run-cell")
    answer = _run_output(check)
    assert f"('{_full_device(target)}', False)" in answer, (answer, status_text)

    # The profile figure is an image (not "<Figure size ...>").
    fig_cell = nb.locator(".jp-CodeCell").filter(has_text='prof.plot("busy")')
    img = fig_cell.locator(".jp-OutputArea-output[data-mime-type='image/png'] img")
    assert img.count() == 1, fig_cell.inner_text()[-500:]
    width = _wait("the profile figure to load", 60,
                  lambda: img.evaluate("i => i.complete && i.naturalWidth"))
    assert width > 300, width
    _shot(fig_cell.locator(".jp-OutputArea"), "profile-busy.png", shots)

    # Last, cluster.stop() as the notebook ends, with no error.
    _select(page, last)
    _menu(page, "Run", "notebook:run-cell")
    _run_output(last)
    _shot(page, "page-end.png", shots)


def _select(page, cell) -> None:
    """Make ``cell`` the active cell, in command mode (a click in its editor, then Escape)."""
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Escape")
    _wait("the cell to be selected", 10, lambda: "jp-mod-active" in cell.get_attribute("class"))


def _menu(page, menu: str, command: str) -> None:
    """Click ``menu`` in the menu bar, then its item for JupyterLab ``command``."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(f"^{menu}$")).click()
    page.locator(f".lm-Menu-item[data-command='{command}']").click()


def _run_output(cell) -> str:
    """Wait for ``cell`` to have run (its prompt shows a number); its output, with no traceback."""
    prompt = cell.locator(".jp-InputPrompt")
    _wait("the cell to run", APPLY_S,
          lambda: re.fullmatch(r"\[\d+\]:", prompt.inner_text().strip()),
          lambda: prompt.inner_text())
    text = " ".join(cell.locator(".jp-OutputArea-output").all_inner_texts())
    assert "Traceback" not in text, text[-2000:]
    return text


def _shot(target, name: str, shots: list) -> None:
    path = ARTIFACTS / name
    target.screenshot(path=path)
    shots.append(path)
