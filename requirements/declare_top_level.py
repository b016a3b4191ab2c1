"""Writes `top_level.txt` into each installed distribution that has none (`make install`'s last step).

transformers calls `importlib.metadata.packages_distributions()` as it is imported, in every process
that imports it: each trainer rank, driver, SGLang server and `rlsys` command. For a distribution
without `top_level.txt` (wheels from most build backends other than setuptools: torch's among them,
92 of this virtualenv's 219) that function infers its top-level names by reading its whole RECORD,
40,000 file entries here: 0.67 s of every such process's start on these CPUs. The names written are
what the function infers (its own `_top_level_inferred`, this Python's), so its answer is unchanged;
a distribution installed or upgraded later is only slower to read, never read wrong.

    python requirements/declare_top_level.py   (the virtualenv's python)
"""

from __future__ import annotations

import sys
import time
from importlib import metadata


def main() -> int:
    infer = getattr(metadata, "_top_level_inferred", None)
    if infer is None:  # another Python's importlib: nothing to write that it would read the same way
        print("rlsys: this Python's importlib.metadata infers no top-level names; nothing written")
        return 0
    start = time.process_time()
    before = metadata.packages_distributions()
    took = time.process_time() - start
    written = 0
    for dist in metadata.distributions():
        if dist.read_text("top_level.txt") is not None or not isinstance(dist, metadata.PathDistribution):
            continue
        names = sorted(infer(dist))
        if not names:
            continue  # an empty file reads as none: the function would infer again anyway
        (dist._path / "top_level.txt").write_text("\n".join(names) + "\n")
        written += 1
    start = time.process_time()
    after = metadata.packages_distributions()
    now = time.process_time() - start
    if {name: sorted(dists) for name, dists in after.items()} != {name: sorted(dists) for name, dists in before.items()}:
        print("rlsys: packages_distributions() changed after writing top_level.txt", file=sys.stderr)
        return 1
    print(f"rlsys: top_level.txt written for {written} distribution(s); packages_distributions() "
          f"{took:.2f} -> {now:.2f} CPU-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
