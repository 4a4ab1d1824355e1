"""The tutorials are tested documentation: each runs end to end in a real kernel (nbclient)."""
from pathlib import Path

import nbformat
import pytest

from tfnb.demo import execute_notebook

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
PAGES = {"placement", "runtime", "serving", "profiling", "faults", "security", "multi-machine",
         "benchmarks", "limits", "kernels"}  # docs/<page>.md


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_end_to_end(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    execute_notebook(nb, tmp_path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not errors
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left in ([], ["scratch"]), f"the tutorial wrote {left} beside itself, not in scratch/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_links_to_the_docs_of_its_concepts(path):
    nb = nbformat.read(path, as_version=4)
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    ends = markdown[0] + markdown[-1]
    links = [part.split(")", 1)[0] for part in ends.split("](../docs/")[1:]]
    assert links, "neither the first nor the last markdown cell links to a page in docs/"
    assert {link.removesuffix(".md") for link in links} <= PAGES, links
