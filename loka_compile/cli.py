"""loka's command line, `python -m loka_compile`:

    python -m loka_compile report PLAN          # a saved plan's summary and every site
    python -m loka_compile plan diff A B        # what differs; exit 1 if anything does
    python -m loka_compile perfdb list|clear|path [--cache-dir DIR]

Bad input (a plan that is missing, not JSON or damaged; an unusable cache directory)
prints one line to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from loka_compile import perfdb
from loka_compile.plan import load_plan
from loka_compile.report import plan_summary, plan_table


def _report(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    print(plan_summary(plan, largest=args.largest))
    print()
    print(plan_table(plan))
    return 0


def _diff(args: argparse.Namespace) -> int:
    """Like diff(1): 0 when the plans decide the same, 1 when they differ."""
    from tabulate import tabulate

    a, b = load_plan(args.a), load_plan(args.b)
    rows = a.diff(b)
    if not rows:
        print(f"plans {args.a} and {args.b} hold the same decisions")
        return 0
    only_a = sum(field == "site" and in_b is None for _, field, _, in_b in rows)
    only_b = sum(field == "site" and in_a is None for _, field, in_a, _ in rows)
    print(f"plans {args.a} (A) and {args.b} (B) differ: {len(rows)} difference(s); "
          f"{only_a} site(s) only in A, {only_b} only in B")
    print(tabulate([(what, field, "-" if x is None else x, "-" if y is None else y) for what, field, x, y in rows],
                   headers=["", "field", "A", "B"]))
    return 1


def _perfdb(args: argparse.Namespace) -> int:
    return perfdb.run(args)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m loka_compile", description="loka: plans and the kernel "
                                  "performance database. Bad input exits 2 with a one-line message.")
    commands = top.add_subparsers(dest="command", required=True, metavar="{report,plan,perfdb}")

    report = commands.add_parser("report", help="a saved plan's summary and table of sites",
                                 description="Print a saved plan's summary and every site (the report's table).")
    report.add_argument("plan", help="a plan file (loka_compile.save_plan)")
    report.add_argument("--largest", type=int, default=5,
                        help="sites left in high precision to list in the summary (default 5)")
    report.set_defaults(run=_report)

    plan = commands.add_parser("plan", help="compare plans", description="Compare saved plans.")
    plan_commands = plan.add_subparsers(dest="plan_command", required=True, metavar="{diff}")
    diff = plan_commands.add_parser(
        "diff", help="what differs between two plans (exit 0 same, 1 different, 2 trouble)",
        description="Sites only in A or only in B; per site in both, its decision (fp8, reason, provider, "
                    "scaling, formats, fast accumulation, padding), Probe verdict and static scale; the header "
                    "(version, recipe, device type) and parameters. Timings and details are not compared. "
                    "Exit status: 0 same, 1 different, 2 trouble (as diff).")
    diff.add_argument("a", help="plan A")
    diff.add_argument("b", help="plan B")
    diff.set_defaults(run=_diff)

    db = commands.add_parser("perfdb", help="the kernel performance database (speed-check timings)",
                             description="loka's kernel performance database: list its entries, clear it, "
                                         "or print its path.")
    perfdb.add_arguments(db)
    db.set_defaults(run=_perfdb)
    return top


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:  # load_plan's and CacheDirError: one line, no traceback
        print(error, file=sys.stderr)
        return 2
