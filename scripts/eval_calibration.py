"""How well the width choice's stale confidences predict acceptance, and what calibrating them
(`jdspark.speculative.calibration`) changes.

The embedded model at fixed width 5 (every position verified) on the serving bench's prompts,
greedy and at T = 1; the calibration learned on prompts 0-3 and judged on 4-7 (a request's first two
steps read the engine's prior, not its own proposals, and are left out):

- E(5) priced from the stated and from the calibrated confidences, against the tokens the steps took;
- a replay of the selector's choice, argmax_k E(k) / S(k) at the step costs given (default: the
  H200's queued profile of the 8-slot engine's bucket 1, tree 1f2d108), against fixed width 5, in
  tokens per ms (a step verified at width k takes min(n_accepted, k) + 1 tokens: the positions past k
  do not matter);
- the same for the four held-out requests run as one batch of 4 at 4-row step costs (`--batch-costs-ms`),
  every row verifying the step's width, from the calibrated confidences and from those smoothed over
  each request's steps (an exponential average, half on the newest proposal): does one step's noisy
  proposal cost the batch its wide widths?
- with `--decode-ms`, a lone request's pauses (`replay_pauses`): decoding `pause_steps` steps where
  drafting does not pay against that decode cost, judged on one step's proposal (the engine before
  f2d6fb8) or on the request's proposals averaged since its last pause (`Sequence.typical`), against
  fixed width 5, in tokens per ms.

    python scripts/eval_calibration.py [--costs-ms 1.67 1.82 1.99 1.88 1.97 1.95] [--decode-ms 0.88] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve_engine  # noqa: E402

from jdspark.engine.request import SamplingParams  # noqa: E402
from jdspark.engine.sequence import MAX_BACKOFF, TYPICAL_WEIGHT  # noqa: E402
from jdspark.speculative.calibration import Calibration  # noqa: E402
from jdspark.speculative.selector import AdaptiveWidth  # noqa: E402

GAMMA = 5


def verified_rows(engine, prompts, temperature: float, max_tokens: int) -> list:
    """The RowRecords of width-5 steps of one request per prompt, each request's first two left out."""
    with engine.record_steps() as records:
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True)
            engine.complete([engine.add(prompt, params)])
    rows, seen = [], {}
    for row in (row for record in records for row in record.rows if row.width == GAMMA):
        seen[row.request_id] = seen.get(row.request_id, 0) + 1
        if seen[row.request_id] > 2:
            rows.append(row)
    return rows


def replay(rows, choose, costs: np.ndarray) -> float:
    """Tokens per ms of the rows' steps at the widths `choose(stale confidence)` picks."""
    widths = [choose(row.stale_confidence) for row in rows]
    tokens = sum(min(row.n_accepted, k) + 1 for row, k in zip(rows, widths))
    return tokens / float(sum(costs[k] for k in widths))


def smoothed(rows, weight: float) -> list:
    """The rows with each request's stale confidences averaged over its steps so far (exponentially,
    `weight` on the newest; 1: as stated). Non-anticipating: a step reads only proposals before it."""
    out, average = [], {}
    for row in rows:
        c = np.asarray(row.stale_confidence, np.float64)
        average[row.request_id] = c if row.request_id not in average else (
            weight * c + (1 - weight) * average[row.request_id])
        out.append(dataclasses.replace(row, stale_confidence=average[row.request_id]))
    return out


def replay_batches(rows, choose_width, costs: np.ndarray, batch: int) -> tuple[float, list[int]]:
    """(tokens per ms, widths chosen) of the rows run `batch` requests at a time, step by step (each
    request's steps in order, zipped across the batch while all have steps left), every row verifying
    the step's width `choose_width([rows' stale confidences])` (the engine's lifted rows)."""
    by_request: dict[int, list] = {}
    for row in rows:
        by_request.setdefault(row.request_id, []).append(row)
    requests = list(by_request.values())
    tokens, seconds, widths = 0, 0.0, []
    for first in range(0, len(requests) - batch + 1, batch):
        for step in zip(*requests[first:first + batch]):
            k = choose_width(np.stack([row.stale_confidence for row in step]))
            tokens += sum(min(row.n_accepted, k) + 1 for row in step)
            seconds += costs[k]
            widths.append(k)
    return tokens / seconds, widths


def replay_pauses(rows, conf, selector: AdaptiveWidth, average: float | None, pause_steps: int = 32,
                  seed: np.ndarray | None = None) -> float:
    """Tokens per ms of each request's width-5 steps (in order) under the engine's pauses: where the
    judged confidences (`conf` of one step's proposal, or under `average` their exponential average
    since the request's last pause, that weight on the newest) make a decode call (`selector.decode_cost`)
    beat every width, the request decodes `pause_steps` tokens (doubling per pause in a row, at most
    32x), then drafts once (a probe) whatever the cost; else it verifies its best width for this
    step's proposal, taking min(n_accepted, k) + 1 of the recorded step's tokens. A decoded stretch
    skips the recorded steps its tokens cover (the next proposal judged is the first step from there).
    `seed`: where a request's average starts (the engine's recent average of every request's
    proposals, `Sequence.typical`), else at its first proposal."""
    by_request: dict[int, list] = {}
    for row in rows:
        by_request.setdefault(row.request_id, []).append(row)
    tokens, ms = 0, 0.0
    for steps in by_request.values():
        start = np.cumsum([0] + [row.n_accepted + 1 for row in steps])
        t = i = paused = backoff = 0
        probing, typical = False, seed
        while i < len(steps):
            if paused:
                t, ms, paused = t + 1, ms + selector.decode_cost, paused - 1
                probing = paused == 0
            else:
                c = conf(steps[i].stale_confidence)
                typical = c if (typical is None or average is None) else average * c + (1 - average) * typical
                if not probing and not selector.drafting_pays(typical[None])[0]:
                    paused, backoff, typical = (pause_steps << backoff) - 1, min(backoff + 1, MAX_BACKOFF), None
                    t, ms = t + 1, ms + selector.decode_cost
                else:
                    k, probing = selector(c), False
                    t, ms = t + min(steps[i].n_accepted, k) + 1, ms + selector.step_costs[k]
                    i += 1
            while i < len(steps) and start[i] < t:
                i += 1
        tokens += t
    return tokens / ms


def evaluate(engine, prompts, temperature: float, costs: np.ndarray, batch_costs: np.ndarray,
             max_tokens: int, decode_cost: float | None = None) -> dict:
    greedy = temperature == 0.0
    train = verified_rows(engine, prompts[:4], temperature, max_tokens)
    test = verified_rows(engine, prompts[4:8], temperature, max_tokens)
    calibration = Calibration(GAMMA, decay=1.0)
    calibration.observe(train, [greedy] * len(train))
    calibration.fold()

    def calibrated(c):
        return calibration(c, greedy)

    selector = AdaptiveWidth(costs, 0.0, GAMMA)  # S(k) = the costs given: the engine's choice and E(k)

    realized = np.array([row.n_accepted + 1 for row in test])
    out = {"temperature": temperature, "train_steps": len(train), "test_steps": len(test),
           "ratios": calibration.ratio(greedy).round(3).tolist(), "realized_tokens_per_step": float(realized.mean()),
           "fixed5_tokens_per_ms": replay(test, lambda c: GAMMA, costs)}
    for name, transform in (("stated", lambda c: c), ("calibrated", calibrated)):
        priced = selector.expected_tokens(np.stack([transform(row.stale_confidence) for row in test]))[:, GAMMA]
        out[name] = {"E5_mean": float(priced.mean()), "E5_mean_abs_error": float(np.abs(priced - realized).mean()),
                     "tokens_per_ms": replay(test, lambda c: selector(transform(c)), costs),
                     "widths": np.bincount([selector(transform(row.stale_confidence)) for row in test],
                                           minlength=GAMMA + 1).tolist()}
    # the four held-out requests as one batch of 4 at the bucket-4 costs, every row at the step's width
    # (the engine's lifted rows), from calibrated confidences as they are and smoothed over each request's steps
    batch_selector = AdaptiveWidth(batch_costs, 0.0, GAMMA)

    def step_width(confidences):
        return int(np.argmax(batch_selector.expected_tokens(confidences).sum(axis=0) / batch_costs))
    calibrated_rows = [dataclasses.replace(row, stale_confidence=calibrated(row.stale_confidence)) for row in test]
    fixed = replay_batches(test, lambda c: GAMMA, batch_costs, 4)[0]
    for name, rows in (("batch4_calibrated", calibrated_rows), ("batch4_smoothed", smoothed(calibrated_rows, 0.5))):
        rate, widths = replay_batches(rows, step_width, batch_costs, 4)
        out[name] = {"vs_fixed5": rate / fixed, "widths": np.bincount(widths, minlength=GAMMA + 1).tolist()}
    if decode_cost is not None:  # a lone request's pauses, judged on one step or on the average
        paused = AdaptiveWidth(costs, 0.0, GAMMA, decode_cost=decode_cost)
        recent = calibrated(np.mean([row.stale_confidence for row in train], axis=0))  # other requests' average
        out["pauses_vs_fixed5"] = {name: replay_pauses(test, calibrated, paused, weight, seed=seed)
                                   / out["fixed5_tokens_per_ms"]
                                   for name, weight, seed in (("one_step", None, None), ("average", TYPICAL_WEIGHT, None),
                                                              ("average_from_recent", TYPICAL_WEIGHT, recent))}
    return out


def engine_args() -> argparse.Namespace:
    """The embedded model's 1-slot engine at width 5, float32, as `bench_serve_engine.py` builds it."""
    return bench_serve_engine.parser().parse_args(["--dtype", "float32", "--max-running", "1", "--buckets", "1",
                                                   "--widths", str(GAMMA), "--modes", "fixed5"])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--costs-ms", type=float, nargs=GAMMA + 1, default=[1.67, 1.82, 1.99, 1.88, 1.97, 1.95],
                    help="S(0..5), a step's cost at each width")
    ap.add_argument("--batch-costs-ms", type=float, nargs=GAMMA + 1, default=[1.70, 1.75, 1.80, 1.85, 1.95, 2.05],
                    help="S(0..5) of a 4-row step (default: the H200's bucket-4 verify windows, thirteenth session)")
    ap.add_argument("--decode-ms", type=float, help="a decode call's cost: also replay a lone request's pauses")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    engine, prompts, _ = bench_serve_engine.build(engine_args())
    costs = np.array(args.costs_ms)
    results = [evaluate(engine, prompts, t, costs, np.array(args.batch_costs_ms), args.max_tokens, args.decode_ms)
               for t in (0.0, 1.0)]
    print("| T | steps (learned on) | tokens / step | E(5) stated (abs err) | E(5) calibrated (abs err) | "
          "selector on stated / fixed5 | on calibrated / fixed5 | widths stated / calibrated | "
          "batch of 4 / fixed5: calibrated, smoothed (steps at k = 0..5) |")
    print("|---:|---|---:|---|---|---:|---:|---|---|")
    for r in results:
        s, c, f = r["stated"], r["calibrated"], r["fixed5_tokens_per_ms"]
        print(f"| {r['temperature']} | {r['test_steps']} ({r['train_steps']}) | {r['realized_tokens_per_step']:.3f} | "
              f"{s['E5_mean']:.3f} ({s['E5_mean_abs_error']:.3f}) | "
              f"{c['E5_mean']:.3f} ({c['E5_mean_abs_error']:.3f}) | "
              f"{s['tokens_per_ms'] / f:.3f} | {c['tokens_per_ms'] / f:.3f} | {s['widths']} / {c['widths']} | "
              + ", ".join(f"{r[k]['vs_fixed5']:.3f} ({r[k]['widths']})"
                          for k in ("batch4_calibrated", "batch4_smoothed")) + " |")
    for r in results:
        if "pauses_vs_fixed5" in r:
            print(f"T = {r['temperature']}: a lone request's pauses at decode {args.decode_ms} ms, / fixed5: "
                  + ", ".join(f"judged on {k.replace('_', ' ')} {v:.3f}" for k, v in r["pauses_vs_fixed5"].items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
