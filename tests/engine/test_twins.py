"""Twins: two instances of an executable taken in turn by call parity (`jdspark.engine.twins`); the
engine-level checks (the same tokens with twins, two instances on the GPU) are in test_executables.py."""

import itertools

from jdspark.engine import twins as twins_module


def test_twins_take_turns_by_the_parity_of_every_call():
    """Two executables' twins share one call count: the instance a call runs is the parity of its
    place among all calls, whichever executable it is (so each instance meets the same buffer
    addresses under overlapped steps)."""
    ran = []

    def fake(name):
        return lambda *args: ran.append(name) or args

    calls = itertools.count()
    a, b = (twins_module.Twins((fake(name), fake(name + "'")), calls) for name in "ab")
    for call in (a, a, b, a, b, b):
        assert call(1, 2) == (1, 2)
    assert ran == ["a", "a'", "b", "a'", "b", "b'"]


def test_verify_and_decode_calls_alternate_whatever_prefills_run_between(monkeypatch):
    """`twins_of` (the engine's wiring): prefills keep their own parity, so a step that prefills and
    verifies still alternates its verify calls between the two instances."""
    ran = []

    def fake(name):
        program = lambda *args: ran.append(name)  # noqa: E731
        program.__name__ = name
        return program

    monkeypatch.setattr(twins_module, "twin", lambda compiled: fake(compiled.__name__ + "'"))
    twins = twins_module.twins_of({(1, "prefill"): fake("p"), (1, "decode"): fake("d"), (1, 5): fake("s")},
                                  itertools.count(), itertools.count())
    for key in [(1, "prefill"), (1, 5), (1, "prefill"), (1, 5), (1, "decode"), (1, "prefill"), (1, 5)]:
        twins[key]()
    assert ran == ["p", "s", "p'", "s'", "d", "p", "s'"]


def test_an_executable_without_a_second_instance_is_left_as_it_is(monkeypatch):
    """Where `twin` gives back the executable itself (the CPU, host callbacks) `twins_of` adds no
    wrapper: nothing to alternate, and no work added to every call."""
    program = lambda *args: args  # noqa: E731
    monkeypatch.setattr(twins_module, "twin", lambda compiled: compiled)
    wired = twins_module.twins_of({(1, "decode"): program}, itertools.count(), itertools.count())
    assert wired[(1, "decode")] is program
