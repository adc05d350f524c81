"""Mutation testing of the rules that guard money and tokens (docs/mutation.md).

mutmut (pinned below) mutates the functions named in `.ci/mutation-targets`, runs for each mutant the
fast-tier tests that reach its function, and this script then prints, per module and per function, how
many mutants the tests killed, and every survivor. A tool to run before a release, not part of CI: the
targets (1,058 mutants) take two to three hours on 2 cores, so it is often run a group at a time.

    python .ci/mutation.py               # run, then report
    python .ci/mutation.py --report      # report the last run (mutants/ is kept between runs)
    python .ci/mutation.py --show NAME   # one mutant's diff
    python .ci/mutation.py --only _token_key --only _unmount   # run and report those targets only
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = os.path.join(ROOT, ".ci", "mutation-targets")
# The mutmut release this script reads the results of (its `mutants/*.meta` files and exit codes).
MUTMUT = "mutmut==3.8.1"
# mutmut's exit codes of a mutant's test run, as its stats module names them.
KILLED, SURVIVED = {1, 3}, {0}
TIMEOUT = {24, -24, 36, 152, 255}
NO_TESTS = {5, 33}
# The share of the targets' mutants the fast tier must kill (issue 32).
KILL_TARGET = 0.90


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="report the last run without running")
    parser.add_argument("--show", metavar="NAME", help="print one mutant's diff")
    parser.add_argument("--children", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--only", metavar="TEXT", action="append", default=[],
                        help="run and report only the targets whose line contains TEXT (repeatable);"
                             " a run reruns every mutant of its targets")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    if args.show:
        return subprocess.call([sys.executable, "-m", "mutmut", "show", args.show])
    targets = read_targets()
    if args.only:
        targets = [target for target in targets if any(text in target for text in args.only)]
        if not targets:
            print("--only %s matches no line of %s" % (" ".join(args.only), TARGETS), file=sys.stderr)
            return 2
    if not args.report:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", MUTMUT])
        code = subprocess.call([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.children)]
                               + targets)
        if code != 0:
            print("mutmut run exited %d" % code, file=sys.stderr)
            return code
    return report(targets)


def read_targets() -> List[str]:
    """The mutant-name patterns of .ci/mutation-targets (one a line; `#` starts a comment)."""
    with open(TARGETS, encoding="utf-8") as handle:
        lines = [line.split("#", 1)[0].strip() for line in handle]
    return [line for line in lines if line]


def report(targets: List[str]) -> int:
    """Print killed / tested per module and function, and every survivor; exit 1 below KILL_TARGET."""
    results = collect(targets)
    if not results:
        print("no results under mutants/: run `python .ci/mutation.py` first", file=sys.stderr)
        return 2
    by_module: Dict[str, Counter] = defaultdict(Counter)
    by_function: Dict[str, Counter] = defaultdict(Counter)
    survivors: List[str] = []
    for name, code in sorted(results.items()):
        status = classify(code)
        function = name.split("__mutmut_")[0]
        by_module[function.split(".")[0]][status] += 1
        by_function[function][status] += 1
        if status == "survived":
            survivors.append(name)
    print("%-64s %8s %8s %8s" % ("module / function", "killed", "tested", "share"))
    total = Counter()
    for module in sorted(by_module):
        print(line(module, by_module[module]))
        total.update(by_module[module])
        for function in sorted(f for f in by_function if f.split(".")[0] == module):
            print(line("  " + function.split(".", 1)[1], by_function[function]))
    print(line("all targets", total))
    if total["not checked"] or total["no tests"]:
        print("not checked: %d, no fast-tier test reaches: %d" % (total["not checked"], total["no tests"]))
    print("\nsurvivors (%d): `python .ci/mutation.py --show NAME`" % len(survivors))
    for name in survivors:
        print("  " + name)
    tested = total["killed"] + total["timeout"] + total["survived"]
    return 0 if tested and (total["killed"] + total["timeout"]) / tested >= KILL_TARGET else 1


def collect(targets: List[str]) -> Dict[str, object]:
    """Exit code per mutant name, for the mutants matching the targets, from mutmut's meta files."""
    results: Dict[str, object] = {}
    for directory, _, files in os.walk(os.path.join(ROOT, "mutants")):
        for file in files:
            if file.endswith(".py.meta"):
                with open(os.path.join(directory, file), encoding="utf-8") as handle:
                    codes = json.load(handle).get("exit_code_by_key", {})
                results.update((name, code) for name, code in codes.items()
                               if any(fnmatch.fnmatchcase(name, pattern) for pattern in targets))
    return results


def classify(code: object) -> str:
    if code is None:
        return "not checked"
    if code in KILLED:
        return "killed"
    if code in SURVIVED:
        return "survived"
    if code in TIMEOUT:
        return "timeout"  # counted as killed: the mutant made a test hang
    if code in NO_TESTS:
        return "no tests"
    return "other"


def line(label: str, counts: Counter) -> str:
    killed = counts["killed"] + counts["timeout"]
    tested = killed + counts["survived"]
    share = "%.0f%%" % (100.0 * killed / tested) if tested else "-"
    return "%-64s %8d %8d %8s" % (label, killed, tested, share)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
