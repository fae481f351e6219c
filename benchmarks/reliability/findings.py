"""What compute-sanitizer reports, grouped by where: one line per distinct finding and its count.

    python benchmarks/reliability/findings.py LOG [LOG ...]

sanitize.sh runs it over its shards' reports (``<tool>-<k>.sanitizer.txt``) so that a run's
output names the source lines behind its error counts, not only the counts: a racecheck hazard
(error or warning) as its kind and the two accesses' kernel and ``file:line`` (hazard reports:
"Write Thread ... at kernel+0x.. in file:line"; analysis reports: "Race reported between Write
access at .. in file:line ... and Read access at .. in file:line [N hazards]"); a memcheck
access error, an initcheck uninitialised read or a synccheck barrier error as its first line
and the kernel and line it names (the kernel and offset where the binary has no line
information); a failed CUDA API call as its call and error (Triton 3.8's loader probing
``cuFuncSetAttribute`` is one per kernel load, see docs/RELIABILITY.md). The reports' own
summaries are summed per tool. Lines it does not recognise are ignored.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

PREFIX = re.compile(r"^=+\s?")
# "at sparse_mla_kernel+0x7350 in ds_mla_sm90_gluon.py:623" (the kernel may be missing; without
# line information the site is the kernel and offset alone)
SITE = re.compile(r"at (?:(?P<kernel>[\w.$]+)\+0x[0-9a-f]+ )?in (?P<loc>\S+?:\d+)")
PC = re.compile(r"at (?P<pc>[\w.$]+\+0x[0-9a-f]+)")
# racecheck reports hazards as errors or, where it judges them benign, warnings
HAZARD = re.compile(
    r"(?:Error|Warning)[^:]*: Potential (?P<kind>\w+) hazard detected at __shared__"
)
THREAD = re.compile(r"^\s*(?P<access>Write|Read) Thread ")
RACE = re.compile(r"Race reported between (?P<first>\w+) access")
RACE_END = re.compile(r"and (?P<second>\w+) access .*\[(?P<n>\d+) hazards?\]")
API = re.compile(r"Program hit (?P<err>\w+) .* on CUDA API call to (?P<call>\w+)")
# memcheck's access errors, initcheck's uninitialised reads, synccheck's barrier errors: the
# first line of each (its site on one of the next lines)
ACCESS = re.compile(
    r"^(?P<what>(?:Invalid __\w+__ (?:read|write|atomic)|Uninitialized __\w+__ memory read"
    r"|Barrier error)[^\n]*?)\s*$"
)
# "ERROR SUMMARY: 2 errors", "RACECHECK SUMMARY: 50 hazards displayed (7205 errors, 0
# warnings)"; not the line that follows a full report ("ERROR SUMMARY: 207 errors were not
# printed"), which the first already counts
SUMMARY = re.compile(
    r"(?P<tool>ERROR|RACECHECK) SUMMARY: (?:\d+ hazards displayed \()?(?P<n>\d+) errors?(?! (?:were|was) not)"
)


def _site(line: str) -> str:
    m = SITE.search(line)
    if not m:
        pc = PC.search(line)
        return pc["pc"] if pc else "?"
    return f"{m['kernel']} {m['loc']}" if m["kernel"] else m["loc"]


def findings(text: str) -> tuple[Counter, Counter]:
    """(distinct findings -> count, summaries -> summed error count) of one report."""
    found: Counter = Counter()
    summaries: Counter = Counter()
    lines = [PREFIX.sub("", x) for x in text.splitlines()]
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := HAZARD.search(line):
            # the two accesses follow: Write Thread ... / Read Thread ...
            sites = []
            j = i + 1
            while j < len(lines) and len(sites) < 2 and (t := THREAD.match(lines[j])):
                sites.append(f"{t['access'].lower()} {_site(lines[j])}")
                j += 1
            found[f"racecheck {m['kind']}: " + " / ".join(sites)] += 1
            i = j
            continue
        if m := RACE.search(line):
            first = _site(line)
            j = i + 1
            while j < len(lines) and not RACE_END.search(lines[j]) and j < i + 4:
                j += 1
            if j < len(lines) and (e := RACE_END.search(lines[j])):
                key = (
                    f"racecheck race: {m['first'].lower()} {first} / "
                    f"{e['second'].lower()} {_site(lines[j])}"
                )
                found[key] += int(e["n"])
                i = j + 1
                continue
        if m := API.search(line):
            found[f"API error: {m['call']} {m['err']}"] += 1
        elif m := ACCESS.match(line):
            # the access's site is on one of the next lines
            site = next((_site(x) for x in lines[i + 1 : i + 4] if PC.search(x)), "?")
            found[f"{m['what']} at {site}"] += 1
        if m := SUMMARY.search(line):
            summaries[m["tool"].lower()] += int(m["n"])
        i += 1
    return found, summaries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path)
    args = p.parse_args(argv)
    total: Counter = Counter()
    sums: Counter = Counter()
    per_file: Counter = Counter()
    for path in args.logs:
        found, summaries = findings(path.read_text(errors="replace"))
        total.update(found)
        sums.update(summaries)
        per_file.update(set(found))
    print(f"== findings in {len(args.logs)} report(s) (count, reports, finding)")
    if not total:
        print("   none")
    for key, n in sorted(total.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{n:7d} {per_file[key]:4d}  {key}")
    for tool, n in sorted(sums.items()):
        print(f"   {tool} summaries: {n} errors in all (the reports print at most --print-limit)")
    if sum(sums.values()) and not total:
        print("   (none of the summaries' errors is of a kind listed above: read the reports)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
