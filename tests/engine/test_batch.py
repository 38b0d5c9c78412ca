"""How many pending prompts a step prefills (`batch.prompts_to_prefill`)."""

from jdspark.engine.batch import prompts_to_prefill


def test_beside_running_requests_the_budget_and_the_padding_of_its_bucket():
    # the smallest bucket holds one prompt: the budget alone
    assert prompts_to_prefill(pending=9, budget_rows=1, buckets=(1, 4, 16), running=True) == 1
    # the smallest bucket is 16: a one-prompt call would pad 15 rows, so up to 16 pending prompts ride in it
    assert prompts_to_prefill(pending=9, budget_rows=1, buckets=(16, 64), running=True) == 9
    assert prompts_to_prefill(pending=40, budget_rows=1, buckets=(16, 64), running=True) == 16
    assert prompts_to_prefill(pending=3, budget_rows=2, buckets=(1, 4, 16), running=True) == 3
    assert prompts_to_prefill(pending=1, budget_rows=2, buckets=(1, 4, 16), running=True) == 1
    assert prompts_to_prefill(pending=6, budget_rows=5, buckets=(1, 4, 16), running=True) == 6  # bucket 16's padding


def test_with_nothing_running_as_many_as_fill_the_largest_bucket_they_fill():
    assert prompts_to_prefill(pending=9, budget_rows=1, buckets=(1, 4, 16), running=False) == 4
    assert prompts_to_prefill(pending=16, budget_rows=1, buckets=(1, 4, 16), running=False) == 16
    # fewer than the smallest bucket: all of them, in its padding
    assert prompts_to_prefill(pending=3, budget_rows=1, buckets=(16, 64), running=False) == 3
    assert prompts_to_prefill(pending=2, budget_rows=1, buckets=(1, 4, 16), running=False) == 1


def test_the_default_budget_takes_every_pending_prompt_up_to_the_largest_bucket():
    """The engine's default budget is every slot (`Engine(prefill_budget=None)`): beside running
    requests too, every pending prompt rides in one call, in the bucket that holds them."""
    assert prompts_to_prefill(pending=8, budget_rows=64, buckets=(1, 4, 16, 64), running=True) == 8
    assert prompts_to_prefill(pending=1, budget_rows=64, buckets=(1, 4, 16, 64), running=True) == 1
    assert prompts_to_prefill(pending=5, budget_rows=16, buckets=(1, 4, 16), running=False) == 5
