import json

from jdspark.experts import bench_bw


def test_bench_bw_small(tmp_path, capsys):
    out = tmp_path / "bw.json"
    rc = bench_bw.main(["--dim", "256", "--inter", "128", "--rows", "1,2", "--repeats", "1", "--bank-experts", "8",
                        "--read-mb", "8", "--formats", "fp4,fp8-f32", "--numba-rows", "", "--no-gpu",
                        "--threads", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["host_read_GBps"] > 0 and res["pcie_h2d"] is None and res["gpu_gemv"] is None
    assert {(g["format"], g["rows"]) for g in res["cpu_gemv"]} == {("fp4", 1), ("fp4", 2), ("fp8-f32", 1), ("fp8-f32", 2)}
    assert all(g["GBps"] > 0 and len(g["calls_ms"]) == 1 for g in res["cpu_gemv"])
    assert all(g[k] is None or 0 <= g[k] <= 1 for g in res["cpu_gemv"] for k in ("steal", "others"))
    assert set(res["rows1_share_of_read"]) == {"fp4", "fp8-f32"}
    assert res["dtype"] == "bfloat16" and all(g["dtype"] == "bfloat16" for g in res["cpu_gemv"])
    assert res["bf16dot"] in (True, False)
    assert "host read:" in capsys.readouterr().out


def test_bench_bw_float32_model(tmp_path):
    out = tmp_path / "bw.json"
    assert bench_bw.main(["--dim", "256", "--inter", "128", "--rows", "1", "--repeats", "1", "--bank-experts", "8",
                          "--read-mb", "8", "--formats", "fp4", "--numba-rows", "", "--no-gpu", "--threads", "1",
                          "--dtype", "float32", "--json", str(out)]) == 0
    assert [g["dtype"] for g in json.loads(out.read_text())["cpu_gemv"]] == ["float32"]


def test_bench_bw_bad_format(capsys):
    assert bench_bw.main(["--formats", "int3", "--no-gpu"]) == 2
    assert "unknown format" in capsys.readouterr().err


def test_gpu_kernel_over_host_experts_and_both_shares_at_once():
    """The GPU rows of `bench bw` run their code path on the CPU too (the kernel interpreted, the
    host bank a plain copy): experts in device memory and in the host bank, and the two shares at
    once, with the split q between 0 and 1."""
    for source in ("device", "host"):
        (row,) = bench_bw.gpu_gemv_sweep("fp4", 512, 256, [2], bank_experts=8, repeats=1, interpret=True,
                                         source=source)
        assert row["source"] == source and row["GBps"] > 0
    both = bench_bw.together("fp4", 512, 256, 1, bank_experts=8, threads=2, repeats=2, interpret=True)
    assert both["cpu_GBps"] > 0 and both["gpu_GBps"] > 0 and 0 < both["pcie_share"] < 1
