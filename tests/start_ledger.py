"""The suite's SGLang and Ray starts, summed over the pytest sessions `make test` runs side by side.

Each session counts only its own starts (tests/conftest.py, RLSYS_TEST_SESSION) and, where START_LEDGER
names a file, appends them to it as one JSON line; `python -m tests.start_ledger FILE` prints the
suite's totals and says when the shared starts are over the budget, which is the suite's, not a session's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The file each session appends its starts to (make test sets it; a plain pytest run checks its own).
START_LEDGER = "RLSYS_START_LEDGER"

# SGLang starts the suite may spend outside the tests whose subject is an engine's start-up, death or
# cleanup (marked own_engines): every other test shares the session's engine sets (docs/design.md).
# 12 as the suite's issue decided, the vision-language engine (tests/e2e/test_vlm.py) among them.
SHARED_START_BUDGET = 12


def over_budget(shared: int) -> str:
    return (f"rlsys: {shared} shared SGLang starts, over the budget of {SHARED_START_BUDGET}: a test that is "
            "not about an engine's own life should use the session's engine sets")


def record_starts(ledger: Path, counts: dict[str, int], shared: int) -> None:
    """One session's starts: `counts` by kind ("sglang", "ray"), `shared` the SGLang starts outside own_engines."""
    with ledger.open("a") as file:
        file.write(json.dumps({**counts, "shared_sglang": shared}) + "\n")


def suite_totals(ledger: Path) -> dict[str, int]:
    totals = {"sessions": 0, "sglang": 0, "ray": 0, "shared_sglang": 0}
    for line in ledger.read_text().splitlines():
        session = json.loads(line)
        totals["sessions"] += 1
        for kind in ("sglang", "ray", "shared_sglang"):
            totals[kind] += session[kind]
    return totals


def main(argv: list[str]) -> int:
    """Prints the suite's starts, and a warning when its shared SGLang starts are over the budget."""
    totals = suite_totals(Path(argv[0]))
    print(f"rlsys: the suite ({totals['sessions']} pytest sessions) started {totals['sglang']} SGLang server(s) and "
          f"{totals['ray']} Ray cluster(s); {totals['shared_sglang']} SGLang start(s) outside the own_engines "
          f"tests (budget {SHARED_START_BUDGET})")
    if totals["shared_sglang"] > SHARED_START_BUDGET:
        print(over_budget(totals["shared_sglang"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
