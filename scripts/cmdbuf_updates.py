"""Which commands XLA re-recorded each time it updated a CUDA graph, from a level-3 log of a GPU run
(`TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=3,command_buffer_cmd=3`).

XLA updates an executable's graph when an allocation its commands use is not where it was on the last
call, and re-records only the commands that use a moved allocation (the others log "Skip updating
command", and the executor sums them up: "Updated N commands in T us (skipped M command updates)"). How
many it re-records says which allocation moved: the one command writing a call's output, the handful
reading its slot inputs, or nearly all of them when the temporary buffer moved. The log's first
recording of each graph is left out. Graphs are told apart by their command count. A build that logs
neither line leaves the count unknown (said so, not guessed).

    python scripts/cmdbuf_updates.py vlog.txt
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import statistics

START = re.compile(r"Create/Update command buffer .*num_commands=(\d+); updated_allocs=(\d+); is_first_record=(\w+)")
SKIP = re.compile(r"Skip updating command (.*)$")
SKIPPED = re.compile(r"Updated \d+ commands in \d+ .*\(skipped (\d+) command updates\)")
END = re.compile(r"(Updated|Recorded) command buffer in (\d+) .*num_commands=(\d+)")


@dataclasses.dataclass
class Update:
    commands: int  # the graph's command count
    moved: int  # allocations that moved (`updated_allocs`)
    skipped: list[str]  # the commands left as they were, by name
    micros: int = 0  # how long the update took on the host
    skipped_count: int | None = None  # the executors' own count of those (None: not logged)

    @property
    def rerecorded(self) -> int | None:
        """Commands re-recorded; None where the log names no skipped command and gives no count."""
        if self.skipped_count is not None:
            return self.commands - self.skipped_count
        return self.commands - len(self.skipped) if self.skipped else None


def updates(lines) -> list[Update]:
    """Every update of a graph after its first recording, in log order."""
    found, current = [], None
    for line in lines:
        if m := START.search(line):
            first = m.group(3).lower() in ("1", "true")
            current = None if first else Update(int(m.group(1)), int(m.group(2)), [])
        elif current is not None and (m := SKIP.search(line)):
            current.skipped.append(m.group(1).strip())
        elif current is not None and (m := SKIPPED.search(line)):  # the graph's own executor logs last
            current.skipped_count = int(m.group(1))
        elif current is not None and (m := END.search(line)):
            current.micros = int(m.group(2))
            found.append(current)
            current = None
    return found


def summary(found: list[Update]) -> str:
    """Per graph: its updates, the allocations moved and the commands re-recorded (how many times each
    count), the update's host time, and the commands some update re-recorded and another skipped."""
    lines = []
    by_graph = collections.defaultdict(list)
    for u in found:
        by_graph[u.commands].append(u)
    for commands, group in sorted(by_graph.items()):
        moved = collections.Counter(u.moved for u in group)
        rerecorded = sorted(collections.Counter(u.rerecorded for u in group).items(),
                            key=lambda kn: (kn[0] is None, kn[0] or 0))  # counts ascending, unknown last
        lines.append(f"graph of {commands} commands: {len(group)} updates, "
                     f"{statistics.median(u.micros for u in group):.0f} us each (median); allocations moved "
                     + ", ".join(f"{k} x{n}" for k, n in sorted(moved.items()))
                     + "; commands re-recorded " + ", ".join(f"{'unknown' if k is None else k} x{n}"
                                                              for k, n in rerecorded))
        seen = set().union(*(u.skipped for u in group))
        sometimes = collections.Counter(c for u in group for c in seen - set(u.skipped))
        for name, n in sometimes.most_common(8):
            lines.append(f"  re-recorded in {n} of {len(group)}: {name[:160]}")
    return "\n".join(lines) if lines else "no graph updates after the first recordings"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="the run's log (stderr), at XLA's level 3 for the command-buffer files")
    args = p.parse_args(argv)
    with open(args.log, errors="replace") as f:
        print(summary(updates(f)))


if __name__ == "__main__":
    main()
