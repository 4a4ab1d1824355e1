"""Shared fixtures: real TF worker processes on 127.0.0.1, one cluster per test session."""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import warnings  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def local_workers():
    """Two worker processes for the whole session (starting TF costs seconds each)."""
    from tfnb.cluster import LocalCluster

    lc = LocalCluster(2)
    yield lc
    lc.close()


@pytest.fixture
def cluster(local_workers):
    """This process connected to the session's two workers (reconnects if a test moved it)."""
    import tfnb
    from tfnb.cluster.security import ExposedServerWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExposedServerWarning)
        return tfnb.connect(local_workers, timeout=5.0)


@pytest.fixture(scope="session")
def ipython():
    """A real IPython shell with the tfnb extension loaded (one per session, as IPython allows)."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "tfnb")
    return shell
