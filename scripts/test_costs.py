"""Per-module test time from a JUnit XML report: the table of docs/testing.md.

    PYTEST_ADDOPTS=--junitxml=/tmp/junit.xml bash scripts/test.sh      (or bash .ci/run)
    python scripts/test_costs.py /tmp/junit.xml [--top N]

Seconds per module are the sum of its tests' setup + call + teardown (pytest's junit_duration_report=total),
i.e. what the module costs the worker that ran it; with two xdist workers the suite's wall time is about half
the total.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def module_costs(path: str) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
    """(seconds, tests, failed-or-errored tests) per module file of the report at `path`."""
    secs: dict[str, float] = collections.defaultdict(float)
    tests: dict[str, int] = collections.Counter()
    bad: dict[str, int] = collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split("@")[0]
        parts = module.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()  # a test class: its module is the last test_* part
        name = "/".join(parts) + ".py" if parts else module
        secs[name] += float(case.get("time", 0.0))
        tests[name] += 1
        bad[name] += sum(1 for child in case if child.tag in ("failure", "error"))
    return secs, tests, bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit")
    ap.add_argument("--top", type=int, default=0, help="only the N most expensive modules (0: all)")
    args = ap.parse_args()
    secs, tests, bad = module_costs(args.junit)
    rows = sorted(secs, key=secs.get, reverse=True)
    print("| module | tests | seconds |")
    print("|---|---:|---:|")
    for name in rows[: args.top or None]:
        flag = f" ({bad[name]} failed)" if bad[name] else ""
        print(f"| {name} | {tests[name]}{flag} | {secs[name]:.1f} |")
    print(f"| **all {len(rows)} modules** | {sum(tests.values())} | {sum(secs.values()):.1f} |")


if __name__ == "__main__":
    main()
