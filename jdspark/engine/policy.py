"""How the engine speculates: its width policy (a given one, a fixed width, or the adaptive selector
over the costs measured per batch bucket), changing it between steps (`set_policy`), and, with
`defer_steps`, taking the step executables built in the background (`poll`, `jdspark.engine.deferred`).
A part of `Engine` (its base class): it reads and sets the engine's speculation fields."""

from __future__ import annotations

import time

from jdspark.engine import calls, costs, deferred
from jdspark.engine.errors import EngineError
from jdspark.engine.options import SpecOptions, WidthPolicy
from jdspark.speculative.selector import AdaptiveWidth


class SpeculationPolicy:
    """`Engine`'s speculation settings: `speculative`, `width_policy`, `selector` / `selectors` / `live`
    (the measured costs), `options`; set up by `Engine.__init__`."""

    def _width_policy(self, policy: WidthPolicy | None, widths: tuple[int, ...], speculative: bool,
                      measure: bool = True) -> WidthPolicy | None:
        """The given policy, a fixed width, or the adaptive selector over measured costs (`measure`
        False: only checked, None returned for it, as before the step executables exist)."""
        gamma, width = self.config.gamma, self.options.width
        if policy is not None or not speculative:
            return policy or (lambda confidence: gamma)
        if width is not None:
            return lambda confidence: width
        if gamma not in widths:
            raise EngineError(f"adaptive width needs width gamma={gamma} compiled (every width rounds up to a "
                              f"compiled one), got {widths}")
        return self._measure() if measure else None

    def _measure(self) -> AdaptiveWidth:
        """The selectors of `options.profile`, measured once per profile (`costs.measured_selectors`)."""
        if self.options.profile not in self._measured:
            self._measured[self.options.profile] = costs.measured_selectors(self)
        self.selectors, self.selector, self.live = self._measured[self.options.profile]
        return self.selector

    def poll(self, force: bool = False, queued: bool = False) -> bool:
        """Take the step executables if their build ended (`defer_steps`; `step` calls it too) and now is
        the moment (`deferred.StepBuild.may_be_taken`, or `force`): their costs measured where adaptive
        widths need them, then speculation on (unless `set_policy` turned it off). `queued`: requests wait
        to be admitted (a server's queue), so the engine is not idle even with no request running.
        Returns whether they are still to be taken."""
        build, idle = self._build, not (self.running or queued)
        if build is not None and build.ready and (force or build.may_be_taken(idle, self._take_measures)):
            self._build = None
            policy, widths = self._policy_when_built
            if deferred.take(self, build, lambda: setattr(self, "width_policy", self._width_policy(policy, widths, True))):
                self.speculative = self._speculate_when_built
            self._last_read = time.perf_counter()  # the call read next was issued before: its time is not the take's
        return self._build is not None

    def _take_measures(self) -> bool:
        """Whether taking the built step executables measures their costs: adaptive widths (the policy
        set when built, `_width_policy`) whose costs are not stored."""
        policy, _ = self._policy_when_built
        return policy is None and self.options.width is None and not costs.profiled(self)

    def wait_for_steps(self, timeout: float | None = None) -> bool:
        """Block until the step executables are built (`defer_steps`), then take them (`poll`, whatever
        runs); whether the build ended within `timeout` seconds."""
        if self._build is not None and not self._build.wait(timeout):
            return False
        self.poll(force=True)
        return True

    def measure_call_costs(self, bucket: int | None = None) -> dict[str, float]:
        """Seconds per call of `decode` and each step[k] ("step{k}") of a batch bucket (default the largest),
        every row active at full width, on emptied state (`costs.measure_bucket`: the fastest of
        `profile_runs` under `options.profile`, cached unless `reprofile`); before any request."""
        return costs.measure_bucket(self, bucket or max(self.config.buckets))

    def policy(self) -> dict:
        """How the engine speculates now, as `set_policy` takes it."""
        return {"speculative": self.speculative, "width_policy": self.width_policy, "options": self.options,
                "overlap": self.overlap}

    def set_policy(self, *, speculative: bool | None = None, width_policy: WidthPolicy | None = None,
                   options: SpecOptions | None = None, overlap: bool | None = None) -> None:
        """Change how the engine speculates, between steps, on the executables it compiled: speculation
        on or off, the width policy (`selector` is the measured adaptive one), the options (a new
        breaker applies to requests admitted afterwards; a new `profile` measures the costs again),
        overlapped steps or not (those two only while no request runs). Benchmarks compare so."""
        if speculative and self._build is not None:
            raise EngineError("speculative=True: the step executables are still being built (defer_steps); "
                              "the engine speculates once they are (wait_for_steps() waits for them)")
        if speculative and not self.exe.step:
            raise EngineError("speculative=True: this engine compiled no step widths (it was built with "
                              "speculative=False); build one with speculative=True")
        if overlap is not None and overlap != self.overlap:
            if self.running:
                raise EngineError(f"overlap={overlap}: requests are running; change it when none runs")
            for call in self._unread:  # calls of requests that ended before their reads: nothing to emit
                calls.read_output(call.out, self.config.gamma)
            self._unread, self.overlap = [], overlap
        if options is not None:
            options.breaker()  # validates before anything changes
            remeasure = bool(self.selectors) and options.profile != self.options.profile
            if remeasure and self.running:
                raise EngineError(f"profile={options.profile!r}: requests are running; change it when none runs")
            self.options, adaptive = options, self._adaptive()
            if remeasure:
                selector = self._measure()  # the new profile's selectors; the adaptive policy follows them
                self.width_policy = selector if adaptive else self.width_policy
        if speculative is not None:
            self.speculative = speculative
            self._speculate_when_built = self._speculate_when_built and speculative
        if width_policy is not None:
            self.width_policy = width_policy
            if self._build is not None:  # what the engine takes the step executables with
                self._policy_when_built = (width_policy, self._policy_when_built[1])
        if self._build is not None and (width_policy is not None or options is not None):
            self._build.reconsider()  # whether taking them measures may have changed

    def _adaptive(self) -> bool:
        return self.selector is not None and self.width_policy is self.selector

    def _policy_at(self, bucket: int) -> WidthPolicy:
        """The width policy in use at a batch bucket: the measured selector's there, corrected by
        the steps' costs (`live`), or the policy set."""
        return self.live.policy(bucket) if self._adaptive() else self.width_policy

    def cost_summary(self, bucket: int | None = None) -> dict:
        """`costs.summary` of the width policy in use at a batch bucket (default the largest; `live` costs)."""
        return costs.summary(self._policy_at(bucket or max(self.config.buckets)))
