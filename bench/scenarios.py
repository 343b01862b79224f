"""Every scenario of the suite, the slow ones (live clusters on Ray) included: each claim of the background
reading beside the emulated figure and its verdict (``run_cluster.py scenario run all``).

``--quick``: each scenario's quick rows. ``--out DIR`` writes ``DIR/scenarios.json`` (then
``run_cluster.py report DIR`` renders it). The last stdout line is one JSON object: per claim the card's
text (the baseline it is tested against), the emulated figure and the verdict.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from run_cluster import main as cli

    argv = ["scenario", "run", "all", "--json", *sys.argv[1:]]
    return cli(argv)


if __name__ == "__main__":
    raise SystemExit(main())
