"""Where the benchmarks write their tables: ``benchmarks/results/NAME.md`` and ``NAME.json``."""
from __future__ import annotations

import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_results(name: str, markdown: str, data, out: str = RESULTS) -> None:
    """Write ``markdown`` to ``out/NAME.md`` and ``data`` as JSON to ``out/NAME.json``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
