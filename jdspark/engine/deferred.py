"""Speculation that comes online after start-up: the engine serves target-only from its prefill and
decode executables while a background thread builds the step[k] executables, then takes them.

Why: a cold start-up compiles every program, and most of them are the step widths (the embedded
8-slot engine: 18 of 24 programs; on the H200 its cold start took 93.8-129 s, nearly all of it compiling
on the host's 16 cores). Target-only serving needs prefill and decode alone, so the server answers
requests after those few compile, and speculates once the rest are built. A warm start-up loads the
stored step executables in the background too: serving comes first (paired on an H100, loading all 24
at start-up served and speculated at 26-28 s, the background load served at 11 s and speculated at
25-28 s; docs/BENCHMARKS.md). The output does not change: a request's tokens are lossless at any width,
0 included (a decode call also feeds the drafter's context, so a running request drafts as soon as
the widths come).

The thread loads or compiles the step executables (compile workers where the engine uses them) and
calls each once, on a decode state of its own (one more state while it runs): the engine's state is
the running requests'. The engine takes them at a step or `Engine.poll` after they are ready
(`take`; `StepBuild.may_be_taken`: while it is idle, where it can): there, on that same spare state,
it measures their costs (for adaptive widths; stored per program, so a warm start-up reads them)
while no other call runs, then installs them and speculates. That measurement is the engine thread's
one pause (none where the costs are stored), taken while no request runs unless none came for
TAKE_WAIT_S.
A failed build (or cost measurement) is logged, and the engine keeps serving target-only. While the
build runs it shares the host with the served steps (on a GPU its compiles run in worker processes,
on the CPU in this one's threads), so target-only steps then run slower than after it; and on a GPU
XLA's autotuning of those programs runs beside the served calls (what it picks is stored with them).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
TAKE_WAIT_S = 30.0  # how long an ended build waits for an idle engine before it is taken anyway


class StepBuild:
    """The step executables being built in a background thread, on a spare decode state."""

    def __init__(self, exe, spare_state):
        """`exe`: the engine's `Executables` (prefill and decode compiled); `spare_state`: a fresh
        (decode state, draft cache) for the thread's compiles and first calls, and the cost profile."""
        self.exe, self.spare = exe, spare_state
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.seconds = 0.0  # how long the build took
        self._instant: bool | None = None  # whether taking it measures nothing (`may_be_taken`)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, name="jdspark-step-executables", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            self.exe.compile(*self.spare, which="steps")
            self.spare = self.exe.warm_up(*self.spare, which="steps")
        except BaseException as error:  # noqa: BLE001 - handed to the engine's thread, which logs it
            self.error = error
        finally:
            self.seconds = time.perf_counter() - self.started
            self._done.set()

    @property
    def ready(self) -> bool:
        """Whether the build ended (built, or failed: `error`)."""
        return self._done.is_set()

    def may_be_taken(self, idle: bool, measures: Callable[[], bool]) -> bool:
        """Whether the engine takes the ended build now: at once where taking it measures nothing
        (`measures()`, asked once until `reconsider`: a fixed width, or costs stored) or it failed
        (logged then), else while the engine is `idle` (the measurement pauses its thread: 3.3 s for
        `jdspark serve`'s engine on the H200, 19-61 s on the 2-core CPU), or once the build has waited
        TAKE_WAIT_S for such a moment (a server that is never idle pays the pause once)."""
        if self._instant is None:
            self._instant = self.error is not None or not measures()
        return self._instant or idle or time.perf_counter() - self.started - self.seconds >= TAKE_WAIT_S

    def reconsider(self) -> None:
        """Ask `measures()` again at the next `may_be_taken` (the width policy or the options changed)."""
        self._instant = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build ends (or `timeout` seconds pass); whether it ended."""
        return self._done.wait(timeout)


def take(engine, build: StepBuild, install) -> bool:
    """In the engine's thread, once `build` is ready: `install()` (the engine's width policy over the
    new executables: for adaptive widths it measures their costs, on the spare state, swapped in for
    the call). Returns whether speculation may come online; False where the build or `install` failed
    (logged: the engine stays target-only, its requests untouched). Where start-up's objects were
    frozen out of the garbage collector (`Scheduler.start`), the build's join them."""
    begun, running = time.perf_counter(), (engine.state, engine.draft_cache)
    error = build.error
    if error is None:
        engine.state, engine.draft_cache = build.spare
        try:
            install()
        except Exception as failure:  # noqa: BLE001 - a server keeps serving target-only
            error = failure
        finally:
            engine.state, engine.draft_cache = running
    build.spare = build.error = None  # the spare state goes now (an error's traceback would keep it)
    if error is not None:
        log.error("the step executables could not be taken %.1f s after the target-only start; serving "
                  "target-only: %r", time.perf_counter() - build.started, error)
        return False
    if gc.get_freeze_count():
        gc.collect()
        gc.freeze()
    log.info("speculation online %.1f s after the target-only start (step executables built in %.1f s in the "
             "background; costs %.2f s)", time.perf_counter() - build.started, build.seconds,
             time.perf_counter() - begun)
    return True
