"""scripts/cmdbuf_updates.py: a level-3 XLA log's graph updates, the first recordings left out, the
commands each update re-recorded counted from those it skipped."""

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
spec = importlib.util.spec_from_file_location("cmdbuf_updates", SCRIPTS / "cmdbuf_updates.py")
tool = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = tool  # its dataclass looks its module up
spec.loader.exec_module(tool)

PREFIX = "I1207 16:09:28.706138    7919 command_buffer_thunk.cc:336] [0] "


def update_lines(commands: int, moved: int, skipped: list[str], micros: int, first: bool = False) -> list[str]:
    lines = [PREFIX + "Create/Update command buffer by recoding command buffer cmd sequence after 1 executions since "
             f"last update; num_commands={commands}; updated_allocs={moved}; is_first_record={int(first)}; "
             "needs_update=1"]
    lines += [f"I1207 16:09:28.7 7919 command_executor.cc:400] Skip updating command {c}" for c in skipped]
    lines.append(PREFIX + f"{'Recorded' if first else 'Updated'} command buffer in {micros} μs; "
                 f"num_commands={commands}")
    return lines


def test_updates_leave_out_first_recordings_and_count_the_rerecorded_commands():
    log = [*update_lines(4, 6, [], 900, first=True), "unrelated line",
           *update_lines(4, 1, ["fusion.1", "fusion.2", "fusion.3"], 300),
           *update_lines(4, 1, ["fusion.1", "fusion.2", "fusion.4"], 500),
           *update_lines(7, 2, ["a"], 700)]
    found = tool.updates(log)
    assert [(u.commands, u.moved, u.rerecorded, u.micros) for u in found] == [(4, 1, 1, 300), (4, 1, 1, 500),
                                                                             (7, 2, 6, 700)]
    text = tool.summary(found)
    assert "graph of 4 commands: 2 updates, 400 us each (median); allocations moved 1 x2; commands re-recorded 1 x2" \
        in text
    assert "re-recorded in 1 of 2: fusion.4" in text and "re-recorded in 1 of 2: fusion.3" in text
    assert "graph of 7 commands: 1 updates" in text


def test_a_log_without_updates_says_so():
    assert tool.summary(tool.updates(update_lines(4, 6, [], 900, first=True))) == \
        "no graph updates after the first recordings"


def test_the_executors_count_is_read_and_a_log_with_neither_line_leaves_the_count_unknown():
    counted = update_lines(9, 1, [], 400)
    counted.insert(1, "I1207 command_executor.cc:420] Updated 9 commands in 350 μs (skipped 8 command updates)")
    unnamed = update_lines(9, 1, [], 450)
    found = tool.updates([*counted, *unnamed])
    assert [u.rerecorded for u in found] == [1, None]
    assert "commands re-recorded 1 x1, unknown x1" in tool.summary(found)
