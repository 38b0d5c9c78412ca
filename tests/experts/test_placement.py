import numpy as np
import pytest

from jdspark.experts.placement import expert_sizes, plan_placement, routing_counts

FLASH = expert_sizes(43, 256, "fp4", 4096, 2048)  # 13,369,344 B each, 147.2 GB


def test_everything_fits():
    p = plan_placement(FLASH, FLASH.sum())
    assert p.on_gpu.all() and p.host_bytes == 0 and p.host_share == 0 and p.host_layers == []
    assert "host 0.00 GB" in p.report() and "GPU 100.0%" in p.report()


def test_uniform_flash_groups_host_experts_into_few_layers():
    budget = 120e9
    p = plan_placement(FLASH, budget)
    deficit = FLASH.sum() - budget
    assert p.gpu_bytes <= budget and p.host_bytes >= deficit
    assert p.host_bytes - deficit < 13_369_344  # no expert more than needed
    per_layer = FLASH[0].sum()
    assert len(p.host_layers) == int(np.ceil(deficit / per_layer))  # 27.2 GB / 3.42 GB -> 8 layers
    assert p.host_share == pytest.approx(p.host_bytes / FLASH.sum())
    assert not p.measured and "uniform routing assumed" in p.report()
    assert f"{len(p.host_layers)} host round trips/step" in p.report()


def _skewed(n_l=8, n_e=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.zipf(1.6, (n_l, n_e)).astype(np.float64)


def test_hot_experts_stay_on_the_gpu():
    counts = _skewed()
    sizes = np.full(counts.shape, 1000)
    p = plan_placement(sizes, sizes.sum() * 0.7, counts)
    assert p.measured and p.gpu_bytes <= sizes.sum() * 0.7
    for layer in p.host_layers:
        host, gpu = counts[layer, p.host_experts(layer)], counts[layer, p.gpu_experts(layer)]
        assert host.max() <= gpu.min()
    # hot first beats a placement by bytes alone: less than the 30% byte share of uses on the host
    assert p.host_share < 0.3


def test_round_trip_cost_trades_layers_for_host_share():
    counts = _skewed(seed=1)
    sizes = np.full(counts.shape, 10_000_000)
    budget = sizes.sum() * 0.75
    spread = plan_placement(sizes, budget, counts, round_trip_ms=0.0)
    grouped = plan_placement(sizes, budget, counts, round_trip_ms=1e6)
    assert len(grouped.host_layers) == 2  # 25% of 8 equal layers: the fewest that hold it
    assert len(spread.host_layers) > len(grouped.host_layers)
    assert spread.host_share < grouped.host_share
    capped = plan_placement(sizes, budget, counts, round_trip_ms=0.0, max_host_layers=3)
    assert len(capped.host_layers) <= 3


def test_errors_and_counts():
    with pytest.raises(ValueError, match="max_host_layers"):
        plan_placement(FLASH, 100e9, max_host_layers=3)
    with pytest.raises(ValueError, match="differ"):
        plan_placement(FLASH, 100e9, counts=np.ones((2, 2)))
    counts = routing_counts([np.array([[0, 1], [1, 3]]), np.array([[2, 3]])], 2, 4)
    assert counts.tolist() == [[1, 2, 0, 1], [0, 0, 1, 1]]
    p = plan_placement(np.full((2, 4), 10), 60, counts, layer_ids=[5, 9])
    assert p.host_bytes == 20 and p.host_layers == [1] and list(p.host_experts(1)) == [0, 1]
    assert p.host_share == 0.0 and "2 experts in 1 layers: 9)" in p.report()
