"""The measured selectors of the batch buckets, corrected by what the engine's steps take
(`LiveCosts`): the profile (`costs`) prices each executable once at start-up; serving prices what the
steps then take."""

from __future__ import annotations

import collections
import statistics

import numpy as np

from jdspark.speculative.selector import AdaptiveWidth


class LiveCosts:
    """The measured selectors of the batch buckets, corrected by what the engine's steps take.

    A step's wall time (`StepRecord.seconds`: the choice, the call, reading its outputs, emitting the
    tokens; overlapped, the time between two reads) is not its executable's profiled time: on the
    H200 with 16 rows the decode steps took 3.1-3.7 ms against a profiled 1.55 (the host's work per
    row), with 1 row 1.6 against 2.85 (one call at a time). So each bucket keeps, per kind of call
    (decode, verify), the median of observed - profiled over its last `SAMPLES` windows, and the
    policy the engine prices with adds it to the decode cost and to every V(k) (floored at zero):
    the shape of V(k) stays the profile's, its level becomes the steps'. A width whose own last
    windows number MIN_WIDTH_SAMPLES or more takes their median instead: where the host paces the
    steps, widths cost alike whatever the profile's slope (H200, embedded model, one request: k = 4
    profiled 0.16 ms cheaper than k = 5, its windows 0.08 ms cheaper, and priced by the profile's
    slope the engine verified k = 4 on most steps, at 0.89x of fixed k = 5). A median, not an average:
    one stalled window (a garbage collection, an executable's first run, the host's other load) is
    not what a call costs, and priced in, it can stop the engine from drafting, and so from ever
    seeing the verify calls that would correct it (H200, embedded model, 4 requests: one round's
    verify windows averaged 5.1 ms against a profiled 2.3, with a 112 ms stall among them, and an
    average kept the engine decoding, at 0.65x of fixed k = 5, for the rounds after). A call carrying a
    prompt segment teaches nothing (a prefill call's time is outside the windows: its read restarts them).

    Switching executables may cost more than issuing the same one again (on the GPU each executable
    is a CUDA graph, which XLA may have to update before launching it after another ran). So a step
    whose time window issued another call than the one before (`issued`) also feeds a third median,
    of its excess over its kind's offset: the bucket's switch cost, which the pricing adds to every
    call but the one issued last (`switch_price`), once both kinds of window were seen
    MIN_SWITCH_SAMPLES times. Where switching costs nothing (the CPU) it stays near zero and the
    choices do not change. Only a switch the choice made teaches it: a window that issued a prefill
    call or a call of another bucket (the live rows' count moved it) teaches no switch: no width choice
    avoids its cost (an H100, the embedded model, c = 64: the tail's moves 64 -> 16 -> 4 -> 1 are such
    windows, and the switch median at bucket 16 then read 2.16 ms).

    Where the host sets the pace (most of a bucket's last windows read a call the device had already
    finished: `StepOutput.ready`), a step costs the host's time whatever its width, and the profile's
    differences between widths are not what the steps pay: every width is then priced at the
    median of the bucket's last verify windows (H100s, embedded model: the reads waited 0.4-0.9 ms of
    1.7-2.9 ms steps for the device, jax's dispatch alone took 0.5-0.8 ms of host time per call, and
    priced by the profile's 0.1-0.3 ms between widths the engine verified k = 3 / 4 on most steps, at
    0.85-0.92x of fixed k = 5, whose steps took no longer); `price_host_paced = False` keeps the
    profile's shape there too (benchmarks compare). `learn=False` keeps the profile as it is
    (benchmarks of the host's work).

    Windows a bucket no longer sees cannot correct its prices: after FORGET_AFTER decode windows in a
    row, the bucket forgets what its verify and switched windows taught, and prices by the profile
    again until new ones come (an H100, embedded model, one request: a burst of stalled verify
    windows, 2.3-10.1 ms among 1.6 ms ones, made 5 of the last 9, the median priced verify above the
    decode call, and with a learnt switch of 1.0 ms added to every verify after it, the engine decoded
    for the level's 2000 steps and the next level's, at 0.67x of fixed k = 5). After FORGET_AFTER verify
    windows in a row it forgets what its decode windows taught, where the device paced most of them
    (their reads waited for the call): there the profile is what a decode call costs (an H100, Flash
    dimensions, 4 requests: a burst of slow decode windows, 5.9-15.6 ms among 4.0 ms ones, priced the
    decode call 0.8 ms over its profile, the engine verified k = 3 from then on, at 0.88x of decoding,
    and no decode window came to correct it). Where the host paced them, the profile does not see the
    host's time, and the learnt price stays (the embedded model on an H100, one request: decode
    profiled at 0.66 ms, its windows 1.04).

    Before a bucket's first decode window (and after they are forgotten), the decode call is priced at
    no less than the host's time per step in its last verify windows (their seconds less the reads'
    waits for the device): the host's work is paid whatever the call, and the profile does not see it.
    An H100, embedded model, one request: decode profiled at 0.66 ms and served at 1.04 (the host's),
    and priced by the profile until its first window came, every adaptive round paused drafting within
    its first 3-46 steps, for 30-38 steps (a request of 64 tokens takes ~21)."""

    SAMPLES = 9
    MIN_WIDTH_SAMPLES = 5
    MIN_SWITCH_SAMPLES = 8
    MIN_PACE_SAMPLES = 5
    FORGET_AFTER = 64

    def __init__(self, selectors: dict[int, AdaptiveWidth], learn: bool = True,
                 prefill_s: dict[int, float] | None = None):
        self.selectors, self.learn, self.price_host_paced = selectors, learn, True
        self.prefill_s = prefill_s or {}  # bucket -> its prefill call's profiled seconds (`batch.prefill_waits`)
        self.offsets = {n: {"decode": 0.0, "verify": 0.0} for n in selectors}
        self.switch = dict.fromkeys(selectors, 0.0)  # seconds a switched window takes beyond its kind's offset
        self._samples = {n: {kind: collections.deque(maxlen=self.SAMPLES) for kind in ("decode", "verify", "switch")}
                         for n in selectors}
        self._widths, self.width_offsets, self.windows, self._verify_s, self._host_s = {}, {}, {}, {}, {}
        self._runs = dict.fromkeys(selectors, ("decode", 0))  # (the last window's kind, windows of it in a row)
        # was each decode window's call done (`_forget_decode`)?
        self._decode_ready = {n: collections.deque(maxlen=self.SAMPLES) for n in selectors}
        for n in selectors:
            self._forget(n)
        self._ready = {n: collections.deque(maxlen=self.SAMPLES) for n in selectors}  # was each window's call done?
        # the last call issued; whether this window's calls switched within a bucket / issued a prefill or moved
        self._last, self._switched, self._moved = None, False, False
        self._policies = dict(selectors)  # per bucket, repriced on the first read after an observation
        self._observed: set[int] = set()  # buckets observed since their policy was last repriced

    def policy(self, bucket: int) -> AdaptiveWidth:
        if bucket in self._observed:
            base, offsets = self.selectors[bucket], self.offsets[bucket]
            widths = range(len(base.verify_costs))
            if self.host_paced(bucket) and self._verify_s[bucket]:  # every width costs what the host takes
                verify = np.full(len(widths), max(statistics.median(self._verify_s[bucket]) - base.draft_cost, 0.0))
            else:
                verify = np.maximum(base.verify_costs + np.array([self._verify_offset(bucket, k) for k in widths]),
                                    0.0)
            self._policies[bucket] = self._policies[bucket].repriced(verify, self._decode_price(bucket))
            self._observed.discard(bucket)
        return self._policies[bucket]

    def _decode_price(self, bucket: int) -> float | None:
        """The decode call's seconds: its profile plus what its windows taught; without windows of its own, at
        least the host's time per step in the bucket's verify windows."""
        base = self.selectors[bucket]
        if base.decode_cost is None:
            return None
        price = max(base.decode_cost + self.offsets[bucket]["decode"], 1e-6)
        if not self._samples[bucket]["decode"] and self._host_s[bucket]:
            price = max(price, statistics.median(self._host_s[bucket]))
        return price

    def _forget(self, bucket: int) -> None:
        """The bucket's verify and switched windows forgotten (as at the start): prices from the profile."""
        widths = len(self.selectors[bucket].verify_costs)
        self._widths[bucket] = [collections.deque(maxlen=self.SAMPLES) for _ in range(widths)]
        self.width_offsets[bucket] = [None] * widths  # None: too few windows
        self.windows[bucket] = {"same": 0, "switched": 0}
        self._verify_s[bucket] = collections.deque(maxlen=self.SAMPLES)  # verify windows' seconds
        self._host_s[bucket] = collections.deque(maxlen=self.SAMPLES)  # verify windows' seconds the host took
        self._samples[bucket]["verify"].clear()
        self._samples[bucket]["switch"].clear()
        self.offsets[bucket]["verify"], self.switch[bucket] = 0.0, 0.0

    def _forget_decode(self, bucket: int) -> None:
        """The bucket's decode windows forgotten unless most of them found their call done (the host paced
        them, as `host_paced` reads a bucket): the profile's price."""
        ready = self._decode_ready[bucket]
        if 2 * sum(ready) <= len(ready):
            self._samples[bucket]["decode"].clear()
            self.offsets[bucket]["decode"] = 0.0
            ready.clear()

    def _verify_offset(self, bucket: int, width: int) -> float:
        """Seconds a verify window of `width` takes beyond its profile: its own median once it has
        MIN_WIDTH_SAMPLES windows, else that of every width's."""
        own = self.width_offsets[bucket][width]
        return self.offsets[bucket]["verify"] if own is None else own

    def host_paced(self, bucket: int) -> bool:
        """Whether most of the bucket's last windows (at least MIN_PACE_SAMPLES) read a call the device
        had already finished."""
        ready = self._ready.get(bucket, ())
        return self.price_host_paced and len(ready) >= self.MIN_PACE_SAMPLES and 2 * sum(ready) > len(ready)

    def issued(self, bucket: int, call: int | str, with_prompt: bool = False) -> None:
        """The engine issued a call in `bucket`: a width, "decode" or "prefill" (`with_prompt`: with a segment)."""
        call = ("prompt", call) if with_prompt else call
        if self._last is not None and (bucket, call) != self._last:
            moved = "prefill" in (call, self._last[1]) or self._last[0] != bucket
            self._moved |= moved
            self._switched |= not moved
        self._last = (bucket, call)

    def switch_price(self, bucket: int, with_prompt: bool = False) -> tuple[int | str | None, float]:
        """(the call a step of `bucket` would repeat, with a prompt segment or not: the last issued if it was
        this bucket's and of that kind, else None; the seconds a step pays for issuing any other)."""
        last = self._last[1] if self._last is not None and self._last[0] == bucket else None
        stay = None if isinstance(last, tuple) != with_prompt else last[1] if with_prompt else last  # its kind
        ready = min(self.windows[bucket].values()) >= self.MIN_SWITCH_SAMPLES
        return stay, max(self.switch[bucket], 0.0) if ready else 0.0

    def close_window(self) -> None:
        """A read that observes no step (its requests all ended first): its window's switch does not leak."""
        self._switched = self._moved = False

    def observe(self, bucket: int, drafted: bool, width: int, seconds: float, ready: bool = False,
                prompt: bool = False, waited: float | None = None) -> None:
        """One step of `bucket` read: a verify call of `width` (drafted) or a decode call, `seconds` long,
        `ready`: done on the device when its read began, `prompt`: it carried a prompt segment (learn
        nothing), `waited`: of `seconds`, the read's wait for the device (None: not measured); the calls
        issued since the previous read decide whether its window switched."""
        switched, moved, self._switched, self._moved = self._switched, self._moved, False, False
        base, kind = self.selectors.get(bucket), "verify" if drafted else "decode"
        if prompt or not self.learn or base is None or (not drafted and base.decode_cost is None):
            return  # nothing to learn
        profiled = base.step_costs[width] if drafted else base.decode_cost
        offsets, samples, excess = self.offsets[bucket], self._samples[bucket], seconds - profiled
        if switched and not moved:
            samples["switch"].append(excess - (self._verify_offset(bucket, width) if drafted else offsets[kind]))
            self.switch[bucket] = statistics.median(samples["switch"])
        if switched or moved:
            excess -= self.switch[bucket]
        if not moved:
            self.windows[bucket]["switched" if switched else "same"] += 1
        self._ready[bucket].append(ready)
        if drafted:
            self._verify_s[bucket].append(seconds - (self.switch[bucket] if switched or moved else 0.0))
            if waited is not None:
                self._host_s[bucket].append(max(seconds - waited, 0.0))
        else:
            self._decode_ready[bucket].append(ready)
        samples[kind].append(excess)
        offsets[kind] = statistics.median(samples[kind])
        if drafted:
            own = self._widths[bucket][width]
            own.append(excess)
            if len(own) >= self.MIN_WIDTH_SAMPLES:
                self.width_offsets[bucket][width] = statistics.median(own)
        last, run = self._runs[bucket]
        self._runs[bucket] = kind, run + 1 if kind == last else 1
        if self._runs[bucket][1] >= self.FORGET_AFTER:  # >=: a benchmark may lower it between steps
            if drafted:
                self._forget_decode(bucket)
            else:
                self._forget(bucket)
            self._runs[bucket] = kind, 0
        self._observed.add(bucket)
