"""Every scenario of the suite, the slow ones (live clusters on Ray) included: each claim of the background
reading beside the emulated figure and its verdict (``run_cluster.py scenario run all``).

``--quick`` (seconds): each fast scenario's quick rows; the slow ones, which launch clusters on Ray
(``disagg-crossover``, ``offload``, ``residency``: 70, 47 and 12 s of quick rows here, 127 s in all with the
fast ones), join with ``--with-slow`` or run alone (``run_cluster.py scenario run NAME --quick``). ``--out DIR``
writes ``DIR/scenarios.json`` (then ``run_cluster.py report DIR`` renders it). The last stdout line is one JSON
object: per claim the card's text (the baseline it is tested against), the emulated figure and the verdict.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from run_cluster import main as cli

    args = [a for a in sys.argv[1:] if a != "--with-slow"]
    skip = ["--skip-slow"] if "--quick" in args and "--with-slow" not in sys.argv[1:] else []
    return cli(["scenario", "run", "all", "--json", *skip, *args])


if __name__ == "__main__":
    raise SystemExit(main())
