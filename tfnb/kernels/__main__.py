"""``python -m tfnb.kernels [--force]``: build the packed-weight ops once (as ``scripts/setup``
does)."""

import sys

from tfnb.kernels import build

print(build(force="--force" in sys.argv))
