"""How one step's rows get their widths (`SpecOptions.batch_widths`).

- "per_request": each request its own width from its own stale confidences (its width policy);
  the step runs the narrowest compiled executable that holds the widest, and every row verifies
  at its own width. Under a width policy that is not an `AdaptiveWidth`, a request's tokens then
  depend only on its own confidences and noise, not on its batch-mates. Under adaptive widths
  (an `AdaptiveWidth`: the engine's measured selector, or one given) the rows' choices are the
  starting point of the step's pricing (below), and every speculating row verifies the step's
  width: the executable is padded, so a narrower row would give up drafts and save nothing.
- "padded": every row at the widest width any request chose (the engine before per-request
  widths; kept for comparison).
- "budget": the multi-request budget (Algorithm 1 over stale confidences,
  `speculative.budget`) priced with this batch bucket's measured D and V(k).

All three read only stale confidences, so the choice never sees the block it applies to. Before
any of them, with adaptive widths, a request on which drafting does not pay at all pauses it
(`pause_where_drafting_does_not_pay`, `SpecOptions.pause_steps`). After them, with adaptive widths,
the step is priced as a whole (`price_the_step`): one executable runs every row, so a row that
drafts makes every row pay for the draft.
"""

from __future__ import annotations

import functools

import numpy as np

from jdspark.engine.errors import EngineError
from jdspark.engine.options import WidthPolicy
from jdspark.engine.sequence import RESUME_PROPOSALS
from jdspark.speculative.budget import allocate_widths, padded_cost
from jdspark.speculative.calibration import ROWS_ONE_BY_ONE
from jdspark.speculative.selector import DRAFT_MARGIN, AdaptiveWidth
from jdspark.speculative.stacked import StackedRows, stack


def row_widths(mode: str, stale: dict[int, np.ndarray], speculating: dict[int, bool], policy: WidthPolicy,
               costs: AdaptiveWidth | None) -> dict[int, int]:
    """{slot: drafts to verify} for the step's rows (a row whose breaker is cooling down: 0)."""
    rows = [b for b in stale if speculating[b]]
    if mode == "budget":
        if costs is None:
            raise EngineError("batch_widths='budget' prices widths with the measured costs: use adaptive widths "
                              "(SpecOptions(width=None)), or batch_widths='per_request'")
        chosen = allocate_widths(stack(stale, rows), padded_cost(costs.draft_cost, costs.verify_costs))
        widths = dict(zip(rows, chosen.tolist()))
    elif isinstance(policy, AdaptiveWidth) and rows:
        widths = dict(zip(rows, policy.widths(stack(stale, rows)).tolist()))
    else:
        widths = {b: int(policy(stale[b])) for b in rows}
    if mode == "padded":
        widest = max(widths.values())
        return {b: widest for b in stale}
    return {b: widths.get(b, 0) for b in stale}


def price_the_step(widths: dict[int, int], stale: dict[int, np.ndarray], policy: AdaptiveWidth, compiled, *,
                   may_decode: bool, probing=frozenset(), lifted=frozenset(),
                   probe_confidence: np.ndarray | None = None,
                   switch: tuple[int | str | None, float] = (None, 0.0),
                   typical: dict[int, np.ndarray] | None = None) -> tuple[int | None, dict[int, int]]:
    """(executable width or None for the plain decode call, {slot: width}) for the whole batch.

    The step's call costs S(K) = D + V(K) for its executable width K, whichever rows use it, and a
    decode call costs `decode_cost` for one token per row. So a row in `lifted` verifies K whatever
    it chose (more drafts at no cost); the others verify min(own width, K). The highest expected
    tokens per second over all rows, sum_i E_i(width_i) / S(K), wins among the compiled widths (only
    those up to the rows' own widest while none is lifted: narrower ones clip rows) and, if
    `may_decode` (the engine's pauses are on: a decode call refreshes no confidences, and the
    pauses' probes are what drafts again), the decode call, unless the best width is priced more than
    `selector.DRAFT_MARGIN` above it (what drafting costs beyond its calls); the rows' own choice stays unless
    another is strictly better. Alone and not lifted, a row keeps its own choice: it already
    maximises E(k) / S(k), and the pause compared it with decoding.

    A probing row (`probing`: back from a pause) is judged as a new request would be, at
    `probe_confidence` (default ones, its best case; the engine passes where new requests start):
    if even then no width beats the decode call by `DRAFT_MARGIN`, its probe could not change the choice, and the step
    decodes (the engine keeps the probe for a later step); otherwise the step drafts.

    `switch` = (the call issued last: a width, "decode" or None, the seconds issuing another costs;
    `live_costs.LiveCosts.switch_price`): every call but that one is priced that much dearer. `typical`
    (the rows' `Sequence.typical`, as the pauses judge them; default the stale confidences) prices the
    drafting step against the decode call: a step the pauses let draft is not decoded on one step's
    proposal (a decode call would bring none to correct it)."""
    rows = list(widths)
    expected = policy.expected_tokens(stack(stale, rows))
    own = np.array([widths[b] for b in rows])
    any_lifted = any(b in lifted for b in rows)
    clipped = None if all(b in lifted for b in rows) else np.array([b not in lifted for b in rows])[:, None]
    probe = np.array([b in probing for b in rows])[:, None] if any(b in probing for b in rows) else None
    stay, switch_cost = switch
    step_costs = np.array(policy.step_costs)
    if switch_cost:
        step_costs += switch_cost * np.array([k != stay for k in range(len(step_costs))])
    tokens_per_second = functools.partial(step_rates, own=own, clipped=clipped, step_costs=step_costs, probe=probe)

    first = executable_width(widths, compiled)
    # the rows' own width first, then the others in ascending order: max keeps the first best
    ks = [first, *sorted(k for k in compiled if k != first and (any_lifted or k < first))]
    rates = tokens_per_second(expected).tolist()
    best = max(ks, key=rates.__getitem__)
    if may_decode and policy.decode_cost is not None:
        table = expected if typical is None else policy.expected_tokens(stack(typical, rows))
        could = rates[best] if table is expected else max(tokens_per_second(table)[ks].tolist())
        if probe is not None:
            start = np.ones((1, expected.shape[1] - 1)) if probe_confidence is None else probe_confidence[None]
            probed = tokens_per_second(table, probe_tokens=policy.expected_tokens(start)[0])
            could = max(probed[sorted(compiled)].tolist())
        if len(rows) * (1.0 + DRAFT_MARGIN) / (policy.decode_cost + switch_cost * (stay != "decode")) >= could:
            return None, {b: 0 for b in rows}
    return best, {b: best if b in lifted else min(w, best) for b, w in widths.items()}


def step_rates(table: np.ndarray, own: np.ndarray, clipped: np.ndarray | None, step_costs: np.ndarray,
               probe: np.ndarray | None = None, probe_tokens: np.ndarray | None = None) -> np.ndarray:
    """Expected tokens per second of a step at every width 0..gamma, in one pass (the choice is host time
    in every step), from its rows' E(k) `table`: rows in `clipped` ([R, 1] bool; None: none) verify
    min(own, k), so bring min(E(k), E(own)) (E does not decrease in k); rows in `probe` bring
    `probe_tokens` (E(k) per width) where given."""
    tokens = table
    if clipped is not None:
        tokens = np.where(clipped, np.minimum(table, table[np.arange(len(own)), own][:, None]), table)
    if probe_tokens is not None:
        tokens = np.where(probe, probe_tokens[None], tokens)
    return tokens.sum(axis=0) / step_costs


def price_for_the_batch(widths: dict[int, int], stale: dict[int, np.ndarray], policy: AdaptiveWidth, compiled,
                        sequences, options, speculating: dict[int, bool], probe_confidence: np.ndarray | None = None,
                        switch: tuple[int | str | None, float] = (None, 0.0),
                        typical: dict[int, np.ndarray] | None = None) -> tuple[int | None, dict[int, int]]:
    """`price_the_step` for the engine's rows: their probes read from their sequences (not a row near
    its max_tokens, with too little room for the drafts a probe would price), and kept
    (`Sequence.defer_probe`) where the step decodes; the decode call only while pauses are on.
    Under "per_request" every speculating row is lifted to the step's width (the executable is
    padded: a narrower row would give up drafts and save nothing), and so is a paused one: its
    pause is for steps that would draft for it alone, and here the draft is paid for (not a row
    whose breaker cools down: the breaker stops drafting for the request, whatever it costs).
    "padded" and "budget" keep their own rules, priced the same way."""
    probing = {b for b in stale if sequences[b].probing and sequences[b].draft_room() >= len(stale[b])}
    lifted = ({b for b in widths if speculating[b] or sequences[b].pausing}
              if options.batch_widths == "per_request" else set())
    width, widths = price_the_step(widths, stale, policy, compiled, may_decode=options.pause_steps > 0,
                                   probing=probing, lifted=lifted, probe_confidence=probe_confidence, switch=switch,
                                   typical=typical)
    if width is None:
        for b in probing:
            sequences[b].defer_probe()
    return width, widths


def pause_where_drafting_does_not_pay(policy: AdaptiveWidth, stale: dict[int, np.ndarray],
                                      speculating: dict[int, bool], sequences, steps: int) -> None:
    """Rows whose confidences (`stale`: the engine passes `Sequence.typical` where a request has one)
    make a plain decode call cheaper per token than any width
    (`AdaptiveWidth.drafting_pays`) stop drafting for `steps` steps: `speculating` turns False and
    the request's `Sequence.pause` counts them down. A row just back from a pause drafts once
    first, whatever the cost, so that the confidences it is judged on are fresh; each pause in a row
    is twice as long as the one before (`Sequence.pause`), until drafting pays again. A paused row that
    drafted `RESUME_PROPOSALS` times since its pause, lifted into other rows' steps, is judged on those
    proposals (its typical, rebuilt from them) and resumes drafting where they pay (`Sequence.resume`)."""
    rows = [b for b in stale if speculating[b] and not sequences[b].probing]
    paused = [b for b in stale if sequences[b].pausing and sequences[b].proposals_in_pause >= RESUME_PROPOSALS]
    if not rows and not paused:
        return
    for b, pays in zip(rows + paused, policy.drafting_pays(stack(stale, rows + paused)).tolist()):
        seq = sequences[b]
        if seq.pausing:  # judged again on what it proposed while paused
            if pays:
                speculating[b] = seq.resume()
        elif pays:
            seq.drafting_pays()
        else:
            seq.pause(steps)
            speculating[b] = False


def executable_width(widths: dict[int, int], compiled) -> int:
    """The narrowest compiled step width that holds every row's width."""
    widest = max(widths.values(), default=0)
    fitting = [k for k in compiled if k >= widest]
    if not fitting:
        raise EngineError(f"the width policy chose k={widest}, but only widths {sorted(compiled)} were compiled")
    return min(fitting)


def compiled_widths(model_config, config, speculative: bool, widths, width) -> tuple[int, ...]:
    """The widths to compile, after checking the model can speculate at them (and at the fixed
    `width`, if any) — before anything compiles."""
    if speculative and model_config.dspark is None:
        raise EngineError("speculative=True needs a checkpoint with a DSpark drafter (dspark_* config keys and "
                          "mtp.* drafter tensors); this one has none: use speculative=False")
    dspark_cfg = model_config.dspark
    if dspark_cfg is not None and dspark_cfg.block_size != config.gamma:
        raise EngineError(f"gamma={config.gamma} but the drafter was built for dspark_block_size="
                          f"{dspark_cfg.block_size}; use gamma={dspark_cfg.block_size}")
    if widths is None:
        widths = tuple(range(config.gamma + 1)) if speculative else (0,)
    bad = [k for k in widths if not 0 <= k <= config.gamma or (k and not speculative)]
    if bad or not widths:
        raise EngineError(f"widths={widths}: each must be in 0..gamma={config.gamma} (only 0 without speculation)")
    if speculative and width is not None and width not in widths:
        raise EngineError(f"width={width}: must be one of the compiled widths {sorted(widths)}")
    return tuple(widths)


def judged(stale: dict[int, np.ndarray], sequences, calibration, options, adaptive: bool
           ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray] | None]:
    """(the rows' stale confidences, what pauses and the decode call's price judge) for a step's
    choice. Under the engine's adaptive widths both pass through its calibration
    (`options.calibrate`); with pauses on, the second is each row's `Sequence.typical` (its stale
    confidences until it has one), else None. Past `ROWS_ONE_BY_ONE` rows both come stacked
    (`StackedRows`: the same mapping over one matrix); fewer stay dicts, cheaper for a lone request."""
    if not adaptive:
        return stale, None
    typical = ({b: c if (t := sequences[b].typical) is None else t for b, c in stale.items()}
               if options.pause_steps else None)
    if len(stale) > ROWS_ONE_BY_ONE:  # stacked once: the choice reads them as matrices four to six times
        stale, typical = StackedRows.of(stale), None if typical is None else StackedRows.of(typical)
    if options.calibrate:
        greedy = {b: sequences[b].greedy for b in stale}
        stale = calibration.apply(stale, greedy)
        typical = None if typical is None else calibration.apply(typical, greedy)
    return stale, typical


def within_room(stale: dict[int, np.ndarray], typical: dict[int, np.ndarray] | None, sequences
                ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray] | None]:
    """`judged`'s pair with the drafts past a request's room (`Sequence.draft_room`: before its
    max_tokens) at 0, so that E(k) prices only tokens it can take (64-token requests at acceptance
    0.8 took 2.82-2.89 tokens a row-step at width 3, against E(3) = 2.95). The same mappings when no
    row is near its end, else stacked (`StackedRows`)."""
    gamma = len(next(iter(stale.values()))) if stale else 0
    rooms = {b: room for b in stale if (room := sequences[b].draft_room()) < gamma}
    if not rooms:
        return stale, typical

    def clipped(confidences):  # in one array operation
        rows = StackedRows.of(confidences)
        room = np.array([rooms.get(b, gamma) for b in rows.slots])[:, None]
        return rows.with_matrix(np.where(np.arange(gamma) < room, rows.matrix, rows.matrix.dtype.type(0)))
    return clipped(stale), None if typical is None else clipped(typical)


def choose(stale: dict[int, np.ndarray], speculating: dict[int, bool], policy, adaptive: bool, compiled,
           slots, options, first_confidence, switch: tuple[int | str | None, float] = (None, 0.0),
           typical: dict[int, np.ndarray] | None = None) -> tuple[int | None, dict[int, int]]:
    """(executable width, {slot: width}) of a step over these rows' stale confidences; (None, {}):
    a plain decode call. `policy`: the width policy in use (None: not speculating); `adaptive`:
    it is the engine's measured selector; `compiled`: the step executables by width; `switch`: what
    issuing another call than the last costs (`price_the_step`); `typical`: what pauses and the
    decode call's price judge (`judged`; default the stale confidences). Under the engine's
    selector, the widths and the price then read both without the drafts a request has no room for
    (`within_room`); a pause does not: a request is not paused for being near its end."""
    if options.pause_steps and isinstance(policy, AdaptiveWidth):
        pause_where_drafting_does_not_pay(policy, typical or stale, speculating, slots, options.pause_steps)
    if policy is None or not any(speculating.values()):
        return None, {}
    if adaptive:
        stale, typical = within_room(stale, typical, slots)
    widths = row_widths(options.batch_widths, stale, speculating, policy, policy if adaptive else None)
    if not isinstance(policy, AdaptiveWidth):
        return executable_width(widths, compiled), widths
    width, widths = price_for_the_batch(widths, stale, policy, compiled, slots, options, speculating,
                                        first_confidence, switch, typical)
    return (None, {}) if width is None else (width, widths)
