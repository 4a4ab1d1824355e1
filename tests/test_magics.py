"""%tfcluster in a real IPython shell: thin over the API, one clean line for every bad input."""
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

import tfnb
from tfnb.notebook.magics import parse_tfcluster


def _run(shell, line, capsys):
    """Run a line as a user would type it; return (result, error, what was printed)."""
    res = shell.run_cell(line, store_history=False)
    out = capsys.readouterr()
    return res.result, res.error_in_exec, out.out + out.err


def test_load_ext_registers_the_magic_and_help_is_real(ipython):
    assert "tfcluster" in ipython.magics_manager.magics["line"]
    doc = ipython.magics_manager.magics["line"]["tfcluster"].__doc__
    for flag in ("--timeout", "--tf-config", "--file", "--isolate", "-o OUTPUT"):
        assert flag in doc
    assert "%tfcluster local 2" in doc


def test_load_ext_shows_matplotlib_figures_as_png(ipython):
    """prof.plot(...) returns a Figure made without pyplot: notebooks must still show an image."""
    from matplotlib.figure import Figure

    from tfnb.notebook.magics import show_figures_inline

    fig = Figure(figsize=(2, 1))
    fig.add_subplot().plot([0, 1])
    png = ipython.display_formatter.formatters["image/png"]
    assert png.lookup(fig)(fig).startswith(b"\x89PNG")
    assert show_figures_inline(ipython) is False   # already set: a second load keeps it


def test_connect_status_disconnect(ipython, local_workers, capsys):
    spec = ",".join(local_workers.addresses)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster, err, _ = _run(ipython, f"%tfcluster connect {spec} --timeout 3 -o c", capsys)
    assert err is None and ipython.user_ns["c"] is cluster and tfnb.current() is cluster
    assert cluster.timeout == 3.0 and cluster.spec.addresses == local_workers.addresses
    status, err, _ = _run(ipython, "%tfcluster status -o st", capsys)
    assert err is None and ipython.user_ns["st"] is status and status.all_up
    html = status._repr_html_()
    assert local_workers.addresses[1] in html
    _, err, _ = _run(ipython, "%tfcluster disconnect", capsys)
    assert err is None and tfnb.current(required=False) is None and not cluster.connected
    _, err, printed = _run(ipython, "%tfcluster status", capsys)
    assert isinstance(err, UsageError) and "not connected" in printed and "Traceback" not in printed


def test_connect_from_file_and_tf_config(ipython, local_workers, tmp_path, monkeypatch, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(local_workers.spec.to_json())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c1, err, _ = _run(ipython, f"%tfcluster connect --file {path}", capsys)
        assert err is None and c1.spec == local_workers.spec
        monkeypatch.setenv("TF_CONFIG", f'{{"cluster": {local_workers.spec.to_json()}}}')
        c2, err, _ = _run(ipython, "%tfcluster connect --tf-config", capsys)
    assert err is None and c2.spec == local_workers.spec and tfnb.current() is c2


def test_local_and_stop(ipython, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster, err, _ = _run(ipython, "%tfcluster local 1 -o lc", capsys)
    assert err is None and cluster.local is not None and cluster.status().all_up
    pid = cluster.local.pids[0]
    _, err, _ = _run(ipython, "%tfcluster stop", capsys)
    assert err is None and cluster.local.alive() == [False] and tfnb.current(required=False) is None
    import os
    import time
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


BAD = [
    ("%tfcluster", "action"),
    ("%tfcluster launch", "'launch'"),
    ("%tfcluster local", "None"),
    ("%tfcluster local two", "'two'"),
    ("%tfcluster local 0", "'0'"),
    ("%tfcluster local 65", "'65'"),
    ("%tfcluster local 2 --file x.json", "--file"),
    ("%tfcluster connect", "exactly one"),
    ("%tfcluster connect a:1 --tf-config", "exactly one"),
    ("%tfcluster connect a:1 --timeout -1", "-1"),
    ("%tfcluster connect a:1 --timeout soon", "soon"),
    ("%tfcluster connect a:1 --isolate", "--isolate"),
    ("%tfcluster connect 127.0.0.1 --timeout 1", "no port"),
    ("%tfcluster connect 127.0.0.1:1 --timeout 1", "127.0.0.1:1 (connection refused)"),
    ("%tfcluster connect --file /nonexistent/c.json", "cannot be read"),
    ("%tfcluster status now", "'now'"),
    ("%tfcluster status -o 1x", "'1x'"),
    ('%tfcluster connect "a:1', "cannot parse"),
]


@pytest.mark.parametrize("line, named", BAD)
def test_bad_input_is_one_line_without_traceback_and_changes_nothing(ipython, cluster, capsys, line,
                                                                     named):
    result, err, printed = _run(ipython, line, capsys)
    assert isinstance(err, UsageError) and result is None
    assert named in str(err)
    assert "Traceback" not in printed and printed.strip().startswith("UsageError:")
    assert len(printed.strip().splitlines()) == 1
    assert tfnb.current() is cluster and cluster.connected


words = st.sampled_from(["local", "connect", "status", "stop", "disconnect", "--timeout", "--file",
                         "--tf-config", "--isolate", "-o", "--advertise", "0", "2", "99", "-1", "x",
                         "a:1", "127.0.0.1", "'", '"', "--", "-", "=", "nan", "inf"])
lines = st.lists(st.one_of(words, st.text(max_size=12)), max_size=6).map(" ".join)


@settings(max_examples=300, deadline=None)
@given(lines)
def test_fuzzed_arguments_parse_cleanly(line):
    """Parsing never raises anything but UsageError (and never touches a cluster)."""
    try:
        action, kw, output = parse_tfcluster(line)
    except UsageError as e:
        assert str(e)
    else:
        assert action in ("local", "connect", "status", "disconnect", "stop")
        if action == "local":
            assert 1 <= kw["n_workers"] <= 64
        assert output is None or output.isidentifier()
