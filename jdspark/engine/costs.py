"""Measured costs of the engine's executables, cached on disk per (device kind, model config,
engine config, the executables themselves and what they run on: `programs_key`).

A cost is, per call, what a call adds to `QUEUED` calls of one compiled executable issued back to back on
the engine's state and synchronised once: the fastest of N such samples less the fastest of N samples of
one call, over QUEUED - 1 (`measure`; `SpecOptions(profile="queued")`, the default):
overlapped steps issue a call before reading the one before, so on a GPU the host's dispatch hides
behind the device, and one call at a time prices what serving does not pay (H200, embedded model:
step[5] profiled one at a time at 2.47 ms, its overlapped serving calls 2.01-2.11);
`profile="synchronised"` times one call at a time (what steps cost without overlap). The labels are
timed in interleaved rounds, after warm-up rounds lasting at least `WARM_S`: on the H200 a profile
taken label after label, right after compiling, found the GPU at idle clocks (bucket 1's decode at
2.76 ms against the 1.6 ms its serving steps then took). Every slot is active, as in a full batch
step (idle slots skip writes, so an idle profile under-counts what a call costs); the state is reset
before each call (outside the timed region), so the profile leaves nothing behind. The engine turns
the costs of its decode and step[k] executables into the selector's D and V(k).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.drafter import dspark
from jdspark.engine import exe_cache
from jdspark.engine.calls import slot_inputs
from jdspark.engine.live_costs import LiveCosts
from jdspark.engine.widths import executable_width
from jdspark.model import state
from jdspark.parallel import distributed
from jdspark.speculative.selector import AdaptiveWidth

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return Path(os.environ.get("JDSPARK_CACHE", Path.home() / ".cache" / "jdspark")) / "costs"


def cache_dir_of(options) -> Path:
    """Where an engine's `SpecOptions` keep its cost profiles."""
    return Path(options.cost_cache_dir) if options.cost_cache_dir else default_cache_dir()


def cost_key(model_config: dict, dtype: str, engine_config: dict) -> str:
    """A stable key: the device kind plus a hash of everything that changes the executables."""
    blob = json.dumps({"model": model_config, "dtype": dtype, "engine": engine_config, "profile": "interleaved rounds"},
                      sort_keys=True, default=str)
    kind = jax.devices()[0].device_kind.replace(" ", "_").replace("/", "_")
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def programs_key(exe) -> str:
    """A hash of what the executables are (`Executables.static_key`: the model graph, so a checkpoint
    loaded as stored or decoded at load and a hybrid layer's experts and PCIe share; the parameters'
    layout; the engine's settings) and of what they run on (`exe_cache.environment`: versions, devices,
    flags, the sources): costs measured for other programs are not reused (a config once shared a key
    stored and decoded)."""
    return hashlib.sha256((exe_cache.environment() + exe.static_key()).encode()).hexdigest()[:16]


WARM_S = 0.5  # warm-up rounds run at least this long (clocks up, caches filled)
QUEUED = 4  # calls per timed sample of the "queued" profile (besides samples of one call, `measure`)
TIMING = "a queued call's addition"  # how `measure` prices queued calls (in the cache key: other timings measure again)


def measure(run, labels, runs: int, reset=lambda: None, clock: Callable[[], float] = time.perf_counter,
            calls: dict[str, int] | None = None) -> list[float]:
    """Seconds a call of each label, from the fastest of `runs` timed samples (interference only slows a
    call) in rounds that sample every label once; `run(label, n)` issues n calls and blocks on the last,
    `reset()` (untimed) runs before each sample, `clock` reads the time. A label of `calls[label]` = N >
    1 is also sampled with one call: (fastest N - fastest 1) / (N - 1) is what a call adds to a queue,
    not the first call's idle wait after the sync (an H200 at Flash dimensions: ~1.1 ms; 4-call samples
    had priced the decode call at 4.19 ms against its served 3.79); noise past that: fastest N / N."""
    counts = {label: (calls or {}).get(label, 1) for label in labels}
    samples = [(label, n) for label in labels for n in sorted({1, counts[label]})]
    start = clock()
    while True:  # warm-up rounds
        for label, n in samples:
            reset()
            run(label, n)
        if clock() - start >= WARM_S:
            break
    times = {sample: [] for sample in samples}
    for _ in range(runs):
        for label, n in samples:
            reset()
            begin = clock()
            run(label, n)
            times[label, n].append(clock() - begin)
    fastest = {sample: min(seconds) for sample, seconds in times.items()}
    return [(fastest[label, n] - fastest[label, 1]) / (n - 1) if fastest[label, n] > fastest[label, 1]
            else fastest[label, n] / n for label, n in counts.items()]  # n = 1: one sample, as timed


def load_or_measure(key: str, run, labels: list[str], runs: int, cache_dir: Path | None, reprofile: bool,
                    reset=lambda: None, clock: Callable[[], float] = time.perf_counter,
                    calls: dict[str, int] | None = None) -> dict[str, float]:
    """{label: seconds} from the cache file of `key` when it holds these labels, else measured and stored."""
    path = (cache_dir or default_cache_dir()) / f"{key}.json"
    costs = stored_costs(path, labels, reprofile)
    if costs is not None:
        log.info("costs from %s: %s", path, _fmt(costs))
        return costs
    costs = dict(zip(labels, distributed.from_process_0(measure(run, labels, runs, reset, clock, calls))))
    log.info("profiled costs (fastest of %d runs): %s", runs, _fmt(costs))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # whole or absent: servers may share the directory
    partial.write_text(json.dumps({"labels": list(labels), "costs_s": list(costs.values()), "runs": runs}, indent=1))
    os.replace(partial, path)
    return costs


def stored_costs(path: Path, labels: list[str], reprofile: bool) -> dict[str, float] | None:
    """{label: seconds} of the cache file `path` where it holds these labels (and they are to be read)."""
    # Several processes run every call together, so all measure (none reads a cache it alone may
    # have) and all take process 0's figures: every process then chooses the same widths.
    if not path.exists() or reprofile or jax.process_count() != 1:
        return None
    try:
        data = json.loads(path.read_text())
        return dict(zip(data["labels"], data["costs_s"], strict=True)) if data.get("labels") == list(labels) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:  # a damaged file: measure again
        log.warning("cost cache %s unreadable (%s: %s); measuring the costs again", path, type(error).__name__, error)
        return None


def profiled(engine) -> bool:
    """Whether every batch bucket's costs are stored (`measure_bucket` would read them, not measure)."""
    cache_dir = cache_dir_of(engine.options)
    return all(stored_costs(cache_dir / f"{key}.json", labels, engine.options.reprofile) is not None
               for key, labels in map(functools.partial(bucket_profile, engine), engine.exe.buckets))


def bucket_profile(engine, n: int) -> tuple[str, list[str]]:
    """(the cost cache key, the labels) of batch bucket n's profile (`measure_bucket`)."""
    exe, profile = engine.exe.buckets[n], engine.options.profile
    labels = [*(["prefill"] if exe.prefill is not None else []), *(["decode"] if exe.decode is not None else []),
              *(f"step{k}" for k in sorted(exe.step))]
    mesh = {"mesh": dict(engine.model.mesh.shape)} if engine.model.mesh is not None else {}  # other executables
    key = cost_key(engine.model.config.to_dict(), str(engine.model.dtype),
                   {**dataclasses.asdict(engine.config), "bucket": n, "profile": profile, "timing": TIMING, **mesh,
                    "programs": programs_key(engine.exe)})
    return key, labels


def _fmt(costs: dict[str, float]) -> str:
    return ", ".join(f"{label}={c * 1e3:.2f}ms" for label, c in costs.items())


def measure_bucket(engine, n: int) -> dict[str, float]:
    """{"prefill": s, "decode": s, "step{k}": s} of an engine's batch bucket n (those it compiled: a
    prefill-only bucket has only "prefill"): rows 0..n-1 active at
    full width (the prefill: a full chunk each, its executable's dense work whatever the prompts),
    greedy, on emptied state, each row from tokens of its own (rows alike would route alike: one row's
    experts priced), one call or `QUEUED` at a time (`SpecOptions.profile`, while the state
    has room for them; a prefill one at a time: its long call hides no dispatch worth pricing, and on the
    2-core CPU its queued samples were 34 of the 60 s `jdspark serve`'s 3 buckets took to profile);
    cached per device kind, model, dtype, engine config, bucket, profile and programs (`programs_key`)."""
    config, exe, profile = engine.config, engine.exe.buckets[n], engine.options.profile
    queued = max(1, min(QUEUED, (config.max_seq_len - 1) // (config.gamma + 1))) if profile == "queued" else 1
    active = np.arange(config.max_batch) < n
    zeros = np.zeros(n, np.int32)
    slots, prefill_slots = (slot_inputs(np.zeros((n, config.gamma + 1)), active=np.ones(n, bool),
                                        temperature=np.zeros(n, np.float32), top_k=zeros, top_p=np.ones(n, np.float32),
                                        seed=zeros, counter=zeros, slot=np.arange(n), width=np.full(n, config.gamma),
                                        prompt_len=zeros, reset=np.full(n, reset)) for reset in (False, True))
    rng, vocab = np.random.default_rng(n), engine.model.config.vocab_size
    anchors = rng.choice(vocab, config.max_batch, replace=vocab < config.max_batch).astype(np.int32)
    chunk = (rng.integers(0, vocab, (n, engine.exe.prefill_chunk), dtype=np.int32),
             np.full(n, engine.exe.prefill_chunk, np.int32))  # ids, n_valid: whole chunks, from emptied slots
    key, labels = bucket_profile(engine, n)

    def program(label):
        if label == "prefill":
            return lambda *a: exe.prefill(*a[:3], *chunk, prefill_slots)
        return exe.decode if label == "decode" else exe.step[int(label.removeprefix("step"))]

    calls = {label: program(label) for label in labels}
    per_sample = {label: 1 if label == "prefill" else queued for label in labels}

    def run(label, n):
        for _ in range(n):
            out, engine.state, engine.draft_cache = calls[label](engine.exe.params.arrays, engine.state,
                                                                 engine.draft_cache, slots)
        jax.block_until_ready(out)

    def reset():
        engine.state = state.reset_slots(engine.state, active)
        engine.state = engine.state.replace(anchor=jnp.where(active, anchors, engine.state.anchor))
        engine.draft_cache = dspark.reset_draft_slots(engine.draft_cache, active)
        jax.block_until_ready((engine.state, engine.draft_cache))

    options = engine.options
    measured = load_or_measure(key, run, labels, options.profile_runs, cache_dir_of(options), options.reprofile,
                               reset, calls=per_sample)
    reset()
    return measured


def measured_selector(engine, bucket: int, measured: dict[str, float] | None = None) -> AdaptiveWidth:
    """The adaptive width policy of an engine's batch bucket: (V(0..gamma), D) and the decode call's
    cost measured there (`measured`: the bucket's `measure_bucket`, default measured now). A step[k]
    call drafts and verifies, so it costs S(k) = D + V(k) as a whole; D is S(0) less a plain decode
    call (the same verification without the draft), V(k) = S(k) - D. A width that is not compiled
    runs in the next compiled one's executable and costs its S."""
    measured = measured or engine.measure_call_costs(bucket)
    step = [measured[f"step{executable_width({0: k}, engine.exe.step)}"] for k in range(engine.config.gamma + 1)]
    draft = max(step[0] - measured["decode"], 0.0)
    return AdaptiveWidth([s - draft for s in step], draft, engine.config.gamma,
                         decode_cost=max(measured["decode"], 1e-6))


def measured_selectors(engine) -> tuple[dict[int, AdaptiveWidth], AdaptiveWidth, LiveCosts]:
    """Every batch bucket's `measured_selector` (under the engine's `options.profile`), the largest
    bucket's, and the live costs that correct them, with each bucket's prefill call. With several
    processes the live costs learn nothing and hold no prefill back: both read each process's own
    clock, and every process must issue the same calls (the profile is process 0's)."""
    measured = {n: engine.measure_call_costs(n) for n in engine.exe.buckets}
    selectors = {n: measured_selector(engine, n, measured[n]) for n in engine.config.buckets}
    alone = jax.process_count() == 1
    prefill_s = {n: measured[n]["prefill"] for n in engine.config.prefill_buckets}
    return selectors, selectors[max(selectors)], LiveCosts(selectors, learn=alone, prefill_s=prefill_s if alone else None)


def summary(policy) -> dict:
    """D and V(k) (seconds) a width policy reads; None when it is no AdaptiveWidth (a fixed width, or
    a policy of the caller's)."""
    if not isinstance(policy, AdaptiveWidth):
        return {"draft_cost_s": None, "verify_costs_s": None}
    return {"draft_cost_s": policy.draft_cost, "verify_costs_s": policy.verify_costs.tolist()}
