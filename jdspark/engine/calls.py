"""A call's inputs and outputs: what crosses between the host and an engine executable.

Per-slot inputs go in as `slot_inputs` (int32 [n, 10 + gamma + 1]: the fields, floats bit-cast, then
the prompt tokens a row carries in a verify call; a call with a prompt segment has one more row, the
segment's, and as many token columns as the segment's tokens), results come back as one int32
array: per slot n_accepted, the emitted token, the invalid flag (1: the slot's logits, temperature
or draft probabilities were not finite; its token is -1 and it must end with an error), then for
step[k] the gamma drafted tokens and the gamma confidences (float32 bits); `read_output` splits it
on the host. The prefill returns the same three columns (n_accepted 0), and so does a prompt
segment, in the last row.

Inside a call: `unpack_slots` turns the inputs into `Rows`, `take_rows` / `put_rows` gather and
scatter the rows' slots of the full-batch state (`executables`' batch buckets), and `pack_output`
builds the output array.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jdspark.speculative.verify import Verdict

# Per-slot inputs of every call, in column order, with the dtype each is bit-cast from (active, reset: 0/1).
# prompt_len > 0: the row carries that many prompt tokens (the columns after the fields) instead of
# [anchor, drafts] (`programs.Programs.verify`); reset: the slot is emptied first (a prompt's first chunk).
SLOT_FIELDS = {"active": jnp.int32, "temperature": jnp.float32, "top_k": jnp.int32,
               "top_p": jnp.float32, "seed": jnp.uint32, "counter": jnp.int32, "slot": jnp.int32,
               "width": jnp.int32, "prompt_len": jnp.int32, "reset": jnp.int32}


@struct.dataclass
class SlotSampling:
    """Per-slot sampling parameters and randomness source, as device arrays [B]."""

    temperature: jax.Array  # f32, 0 = greedy
    top_k: jax.Array  # i32, 0 = off
    top_p: jax.Array  # f32, 1 = off
    seed: jax.Array  # u32
    counter: jax.Array  # i32: the slot's step number, so every call draws fresh noise


class Rows(NamedTuple):
    """A call's rows on the device: which state slot each is, and its per-row inputs ([n] each)."""

    slot: jax.Array  # i32: the decode-state slot the row reads and writes
    active: jax.Array  # bool: the row runs (False: padding, its slot is left as it was)
    width: jax.Array  # i32: drafts this row verifies (clipped to the executable's width)
    sampling: SlotSampling
    prompt_len: jax.Array  # i32: prompt tokens the row carries in a verify call (0: a running request's row)
    reset: jax.Array  # bool: the slot is emptied before the call (a prompt's first chunk)
    prompt: jax.Array  # i32 [n, gamma + 1 (a segment call: its tokens)]: those prompt tokens


class StepOutput(NamedTuple):
    """One call's results on the host; drafts and confidence are None for `prefill` and `decode`
    (no drafting)."""

    n_accepted: np.ndarray  # [B] int32
    token: np.ndarray  # [B] int32: the emitted (bonus or residual) token; -1 where invalid
    drafts: np.ndarray | None  # [B, gamma] int32: the proposal (its first n_accepted were accepted)
    confidence: np.ndarray | None  # [B, gamma] float32: the proposal's confidences
    invalid: np.ndarray  # [B] bool: non-finite logits, temperature or draft probabilities (verify.Verdict)
    waited_s: float = 0.0  # how long reading it waited for the device
    ready: bool = False  # whether the device had finished it before the read began (the host set the pace)


def slot_columns(gamma: int, segment: int = 0) -> int:
    """Columns of a call's slot inputs: the SLOT_FIELDS, then gamma + 1 prompt tokens (a call with a prompt
    segment of `segment` >= gamma + 1 tokens: that many)."""
    return len(SLOT_FIELDS) + max(gamma + 1, segment)


def slot_inputs(prompt: np.ndarray, **fields) -> np.ndarray:
    """Every per-row input of a call (the SLOT_FIELDS, each [n]; prompt [n, its token columns]) as one int32 host
    array [n, slot_columns(gamma)]."""
    columns = [np.asarray(fields[name], dtype).view(np.int32) for name, dtype in SLOT_FIELDS.items()]
    return np.concatenate([np.stack(columns, axis=1), np.asarray(prompt, np.int32)], axis=1)


def unpack_slots(slots: jax.Array) -> Rows:
    """slot_inputs on the device -> Rows."""
    column = {name: jax.lax.bitcast_convert_type(slots[:, i], dtype)
              for i, (name, dtype) in enumerate(SLOT_FIELDS.items())}
    sampling = SlotSampling(**{name: column[name] for name in ("temperature", "top_k", "top_p", "seed", "counter")})
    return Rows(column["slot"], column["active"] != 0, column["width"], sampling, column["prompt_len"],
                column["reset"] != 0, slots[:, len(SLOT_FIELDS):])


def take_rows(tree, rows: Rows, batch: int):
    """The rows' slots of a full-batch pytree (the whole tree when the rows are every slot). One row
    is a dynamic slice. XLA on the CPU still copies whole state buffers around the write-back (the
    compressed entries in small buckets; docs/BENCHMARKS.md, serving): the open part of making a
    lone request on many slots as cheap as on one."""
    if tree is None or rows.slot.shape[0] == batch:
        return tree
    if rows.slot.shape[0] == 1:
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, rows.slot[0], 1), tree)
    return jax.tree.map(lambda a: a[rows.slot], tree)


def put_rows(tree, part, rows: Rows, batch: int):
    """`part` written back into the rows' slots of the full-batch `tree` (in place when donated)."""
    if tree is None or rows.slot.shape[0] == batch:
        return part
    if rows.slot.shape[0] == 1:
        return jax.tree.map(lambda a, p: jax.lax.dynamic_update_slice_in_dim(a, p, rows.slot[0], 0), tree, part)
    return jax.tree.map(lambda a, p: a.at[rows.slot].set(p), tree, part)


def fetch_early(results: tuple) -> tuple:
    """A call's (output, state, draft cache) with the output's copy to the host started now: on a GPU
    the read a step later finds it there (the copy overlaps the next call) instead of waiting for a
    device-to-host copy of its own; on the CPU the output is in host memory already."""
    devices = getattr(results[0], "devices", None)  # None: a host array (a test's stand-in)
    if devices is not None and next(iter(devices())).platform != "cpu":
        results[0].copy_to_host_async()
    return results


def read_output(out, gamma: int) -> StepOutput:
    """A prefill, decode or step[k] result (one device-to-host copy) split into its fields."""
    ready, start = bool(getattr(out, "is_ready", lambda: False)()), time.perf_counter()
    out = np.asarray(out)
    waited, invalid = time.perf_counter() - start, out[:, 2] != 0
    if out.shape[1] == 3:
        return StepOutput(out[:, 0], out[:, 1], None, None, invalid, waited, ready)
    return StepOutput(out[:, 0], out[:, 1], out[:, 3:3 + gamma], out[:, 3 + gamma:].view(np.float32), invalid,
                      waited, ready)


def with_anchor(decode, verdict: Verdict, where: jax.Array):
    """The state with each `where` row's anchor set to the token the call sampled (invalid: 0; such a
    request ends, and a call issued before the host saw it runs on a valid id)."""
    return decode.replace(anchor=jnp.where(where, jnp.maximum(verdict.token, 0), decode.anchor))


def pack_output(verdict: Verdict, drafts: jax.Array | None = None, confidence: jax.Array | None = None) -> jax.Array:
    """The device side of `read_output`: int32 [B, 3] (+ 2 gamma with a proposal)."""
    columns = [verdict.n_accepted[:, None], verdict.token[:, None], verdict.invalid.astype(jnp.int32)[:, None]]
    if drafts is not None:
        columns += [drafts.astype(jnp.int32), jax.lax.bitcast_convert_type(confidence.astype(jnp.float32), jnp.int32)]
    return jnp.concatenate([c.astype(jnp.int32) for c in columns], axis=1)
