"""Two loaded instances of each compiled step executable, called in turn, so an overlapped engine's
CUDA graphs are never updated (`EngineConfig.twin_executables`)."""

from __future__ import annotations

import itertools

from jdspark.engine import compiling
from jdspark.engine.exe_cache import twin


class Twins:
    """Two loaded instances of one compiled executable, taken in turn by the parity of a call count the
    engine's verify and decode executables share (prefills count apart; `twins_of`,
    `EngineConfig.twin_executables`).

    Overlapped, a call is issued while the previous call's slot inputs and output are still alive, so
    those buffers take two addresses in turn, and an executable whose buffers are not where they were
    on its last call has XLA update its CUDA graph before it runs (`command_buffer::update` on the
    H200: 0.42 ms a speculative step, 0.39 a decode step, on every call; docs/BENCHMARKS.md). Each of
    two instances called on alternate calls sees one of the two addresses every time, and the updates
    are gone."""

    def __init__(self, pair: tuple, calls: itertools.count):
        self.pair, self.calls = pair, calls

    def __call__(self, *args):
        return self.pair[next(self.calls) % 2](*args)

    def __getattr__(self, name):  # as_text, cost_analysis, ...: the first instance's
        if name == "pair":  # not yet set (a copy being built): no recursion through the line below
            raise AttributeError(name)
        return getattr(self.pair[0], name)


def twins_of(compiled: dict, calls: itertools.count, prefills: itertools.count) -> dict:
    """{(bucket, name): executable} as `Twins` of it and its second instance (`exe_cache.twin`: it
    deserialized again, no second compile): the verify and decode calls share the parity of `calls`, the
    prefills that of `prefills` (a step that prefills and verifies would otherwise put every verify on one
    instance). An executable with no second instance (the CPU, where there is no graph to update; host
    callbacks) stays as it is."""
    with compiling.thread_pool(len(compiled)) as pool:  # loading leaves the GIL (H200: ~0.9 s each one by one)
        second_of = dict(zip(compiled, pool.map(twin, compiled.values())))
    out = {}
    for key, program in compiled.items():
        second = second_of[key]
        parity = prefills if key[1] == "prefill" else calls
        out[key] = program if second is program else Twins((program, second), parity)
    return out
