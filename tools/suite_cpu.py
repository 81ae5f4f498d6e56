"""Where the test suite's CPU goes, per file: sums the lines ``--cpu-times`` wrote.

    python -m pytest --cpu-times=/tmp/cpu        # writes /tmp/cpu.gw0, /tmp/cpu.gw1, ...
    python tools/suite_cpu.py /tmp/cpu [--top 30] [--tests]

Prints the files by CPU seconds (the test processes' own plus the processes they started), with
their test count and summed wall seconds, then the total. ``--tests`` lists single tests instead.
The suite on 2 cores takes about (total CPU seconds) / 1.9 of wall time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import sys


def read(prefix: str) -> list[tuple[str, float, float, float]]:
    rows = []
    for path in sorted(glob.glob(prefix + ".*")):
        with open(path) as f:
            for line in f:
                node, own, kids, wall = line.rstrip("\n").split("\t")
                rows.append((node, float(own), float(kids), float(wall)))
    if not rows:
        raise SystemExit(f"suite_cpu: no {prefix}.* files (run pytest with --cpu-times={prefix})")
    return rows


def per_file(rows):
    cpu, count, wall = collections.Counter(), collections.Counter(), collections.Counter()
    for node, own, kids, w in rows:
        name = node.split("::")[0]
        cpu[name] += own + kids
        count[name] += 1
        wall[name] += w
    return [(cpu[k], count[k], wall[k], k) for k in cpu]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefix")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--tests", action="store_true", help="single tests, not files")
    args = p.parse_args(argv)
    rows = read(args.prefix)
    if args.tests:
        table = [(own + kids, 1, w, node) for node, own, kids, w in rows]
    else:
        table = per_file(rows)
    print(f"{'CPU s':>8} {'tests':>5} {'wall s':>8}  name")
    for cpu, n, wall, name in sorted(table, reverse=True)[: args.top]:
        print(f"{cpu:8.1f} {n:5d} {wall:8.1f}  {name}")
    total = sum(own + kids for _, own, kids, _ in rows)
    print(
        f"total: {total:.0f} CPU s over {len(rows)} tests (about {total / 1.9 / 60:.1f} min "
        "of wall time on 2 cores)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
