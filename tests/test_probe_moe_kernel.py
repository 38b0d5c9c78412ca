"""scripts/probe_moe_kernel.py: its tilings parse as the kernel's fields, and it runs on the CPU."""

import importlib.util
from pathlib import Path

import pytest

from pallas_kernels import moe as moe_kernels

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
spec = importlib.util.spec_from_file_location("probe_moe_kernel", SCRIPTS / "probe_moe_kernel.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_tilings_replace_fields_of_the_default():
    assert probe.parse_tiles("") == moe_kernels.TILES
    tiles = probe.parse_tiles("out=128,swap=True,decode=offset")
    assert (tiles.out, tiles.swap, tiles.decode, tiles.num_warps) == (128, True, "offset", moe_kernels.TILES.num_warps)
    with pytest.raises(SystemExit, match="no Tiles field 'outs'"):
        probe.parse_tiles("outs=4")


def test_probe_runs_each_tiling_against_the_reference_on_the_cpu():
    rows = probe.main(["--dims", "16", "512", "256", "--rows", "1", "3", "--runs", "0",
                       "--tiles", "", "out=16,down_out=32"])
    assert [(r["rows"], r["tiles"]) for r in rows] == [(1, "default"), (1, "out=16,down_out=32"),
                                                       (3, "default"), (3, "out=16,down_out=32")]
    assert all(r["rel_err"] < 1e-2 for r in rows)


def test_probe_runs_the_grouped_form_on_the_cpu():
    """--grouped times `grouped_moe` (the form calls of many rows take) against the same reference."""
    rows = probe.main(["--dims", "16", "512", "256", "--rows", "5", "--runs", "0", "--grouped"])
    assert [(r["rows"], r["form"]) for r in rows] == [(5, "grouped_moe")] and rows[0]["rel_err"] < 1e-2
