"""The functions the engine's executables run (traced by `executables.Executables`, which compiles
them per batch bucket):

- prefill: a prompt chunk into some slots (others pass n_valid = 0; a slot whose `reset` slot input is
  set is emptied first, as in every call), drafter context pushed, the first token sampled from each
  slot's last real row;
- decode: one plain target step (no drafting): the width-0 verification, which emits one token;
- step[k] for k = 0..gamma: one DSpark proposal (gamma tokens, their distributions q, confidences)
  and, in the same executable, the target extend over [anchor, first k drafts] (the anchor: the
  token the slot's last call sampled, kept in the state), exact rejection
  sampling with each row at its own width <= k (the `width` slot input), commit of the accepted
  prefix + 1 in the target state and the committed rows' features pushed into the drafter's
  context. Width 0 drafts too: its confidences choose the next step's width. A row may carry a
  prompt chunk instead (up to k + 1 of its tokens, `Engine.ride_prompts`): extended over them, all
  kept, the token after the last drawn as a prefill would draw it (`verify`);
- decode and step[k] with a prompt segment (`verify_function`): the same call, and in the same
  model pass one more slot's prompt chunk of up to `segment` tokens (its own row of the slot
  inputs, after the verify rows), prefilled as a prefill call would (`DSV4.extend_segments`: the
  routed experts and every weight read once for the verify rows and the chunk).

Every function takes the parameters as an argument (never baked in as constants; on the GPU packed
into a few buffers, `jdspark.engine.packed`, since each argument buffer costs host time per call),
and draws its randomness on the device from per-slot (seed, counter) keys, so a request's samples
depend only on its own seed, step and width (the uniforms are drawn gamma-long and sliced, so the
executable's width does not change them). All noise comes from `sampling.exponential_noise` /
`sampling.uniform_noise`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import EngineConfig
from jdspark.drafter import dspark
from jdspark.engine import packed
from jdspark.engine.calls import Rows, SlotSampling, pack_output, put_rows, take_rows, unpack_slots, with_anchor
from jdspark.model import hyper, state
from jdspark.model.dsv4 import last_rows
from jdspark.model.model import Model
from jdspark.speculative.sampling import exponential_noise, uniform_noise
from jdspark.speculative.verify import accepted_prefix, rejection_sample
from pallas_kernels import resolve_implementation

_PREFILL, _DRAFT, _VERIFY = 1, 2, 3  # key purposes: independent streams per kind of draw


def scripted_accepted(uniforms, width, acceptance: float, invalid) -> jax.Array:
    """`EngineConfig.scripted_acceptance`'s n_accepted [B]: the leading run of u_j < acceptance among
    each row's first width[b] uniforms [B, K] (0 where invalid)."""
    verified = jnp.arange(uniforms.shape[1])[None, :] < width[:, None]
    return accepted_prefix((uniforms >= acceptance) | ~verified | invalid[:, None])


def _keys(sampling: SlotSampling, purpose: int) -> jax.Array:
    base = jax.random.key(purpose)
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(base, s), c))(sampling.seed,
                                                                                     sampling.counter)


def _exponentials(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda k: exponential_noise(k, shape))(keys)


class Segment(NamedTuple):
    """A verify call's prompt segment: its slot's state and draft cache, and its row of the slot inputs."""

    decode: state.DecodeState
    draft_cache: object
    rows: Rows


def _split(rows: Rows, n: int) -> tuple[Rows, Rows]:
    """A call's rows as its first n and the rest (a segment call's verify rows and prompt row)."""
    return jax.tree.map(lambda a: a[:n], rows), jax.tree.map(lambda a: a[n:], rows)


class Programs:
    """The engine's traced functions for one model, engine config, prefill chunk and prompt segment."""

    def __init__(self, model: Model, engine: EngineConfig, prefill_chunk: int, implementation: str,
                 pack_params: bool, segment: int = 0):
        """`implementation`: "auto", "pallas" or "xla" for every kernel (ValueError otherwise); `segment`:
        the prompt tokens a segment call carries (0: no segment calls)."""
        resolve_implementation(implementation)  # validates it before anything is compiled
        self.implementation = implementation
        self.graphdef = hyper.with_implementation(model.graphdef, model.params, implementation)
        self.config, self.dtype = model.config, model.dtype
        # Pass `params.arrays` as every call's first argument.
        self.params = packed.PackedParams(model.params, packed.SMALL_BYTES if pack_params else None,
                                          apart=packed.kernel_scales(model.params, implementation))
        self.dspark = model.config.dspark
        self.gamma = engine.gamma
        self.feature_layers = self.dspark.target_layer_ids if self.dspark else ()
        self.prefill_chunk, self.segment = prefill_chunk, segment
        self.scripted_acceptance = engine.scripted_acceptance  # benchmarks only (EngineConfig)

    def module(self, arrays):
        """The model module over one call's parameter arrays (`params.arrays`), inside a trace."""
        return nnx.merge(self.graphdef, self.params.unpack(arrays))

    def prefill_function(self, params, full_state, full_cache, ids, n_valid, slots):
        model = self.module(params)
        rows, batch = unpack_slots(slots), full_state.batch
        decode, draft_cache = self._rows_in(full_state, full_cache, rows)
        logits, features, decode = model.extend(ids, decode, n_valid, self.feature_layers, last_logits=True)
        verdict, decode, draft_cache = self._prefilled(model, logits, features, decode, draft_cache, n_valid,
                                                       rows.sampling)
        return (pack_output(verdict), put_rows(full_state, decode, rows, batch),
                put_rows(full_cache, draft_cache, rows, batch))

    def _prefilled(self, model, last, features, decode, draft_cache, n_valid, sampling: SlotSampling):
        """After a prompt chunk's extend (`last`: its last real token's logits [B, 1, V]): its drafter context
        pushed and the token after its last real row drawn, left as the anchor (used only after a prompt's
        last chunk). -> (Verdict, decode, draft_cache)."""
        if draft_cache is not None:
            draft_cache = dspark.push_context(model, draft_cache, features, n_valid)
        verdict = self.first_token(last, sampling)
        return verdict, with_anchor(decode, verdict, n_valid > 0), draft_cache

    def first_token(self, last, sampling: SlotSampling):
        """A draw from p of each row's last real token's logits `last` [B, 1, V]: the token a prompt's last
        chunk samples (width 0: no drafts). Verdict with n_accepted 0."""
        b, v = last.shape[0], self.config.vocab_size
        noise = _exponentials(_keys(sampling, _PREFILL), (v,))
        return rejection_sample(last, jnp.zeros((b, 0, v), jnp.float32), jnp.zeros((b, 0), jnp.int32),
                                jnp.zeros((b, 0), jnp.float32), noise, sampling.temperature, sampling.top_k,
                                sampling.top_p, implementation=self.implementation)

    def _rows_in(self, full_state, full_cache, rows: Rows):
        """The call's rows of the state and draft cache, a prompt's slot emptied at its first chunk."""
        batch = full_state.batch
        decode, draft_cache = take_rows(full_state, rows, batch), take_rows(full_cache, rows, batch)
        return (state.reset_slots(decode, rows.reset),
                None if draft_cache is None else dspark.reset_draft_slots(draft_cache, rows.reset))

    def decode_function(self, params, full_state, full_cache, slots):
        return self.verify_function(None, with_prompt=False)(params, full_state, full_cache, slots)

    def step_function(self, k: int):
        """The (uncompiled) step[k]: propose gamma drafts, verify each row's first min(width, k)."""
        return self.verify_function(k, with_prompt=False)

    def verify_function(self, k: int | None, with_prompt: bool):
        """The (uncompiled) verify call: step[k] (k None: decode). `with_prompt`: with a prompt segment, the
        slot inputs' last row is a slot's prompt chunk (its `prompt_len` tokens, <= `segment`; 0: none),
        extended in the same model pass as the verify rows and prefilled as `prefill_function` would
        (emptied at its first chunk, all kept, the token after its last drawn with the prefill's keys); its
        output row follows the verify rows'. The segment's slot may also be one of the verify call's
        padding rows (a full bucket): its write comes last."""
        def step(params, full_state, full_cache, slots):
            model = self.module(params)
            rows, batch = unpack_slots(slots), full_state.batch
            rows, segment_rows = _split(rows, slots.shape[0] - 1) if with_prompt else (rows, None)
            decode, draft_cache = self._rows_in(full_state, full_cache, rows)
            b = rows.slot.shape[0]
            if k is None:
                proposal = None
                drafts, q = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, self.config.vocab_size), jnp.float32)
            else:
                proposal = self.propose(model, draft_cache, decode.anchor, rows.sampling)
                drafts, q = proposal.tokens[:, :k], proposal.q[:, :k]
            segment = None if segment_rows is None else Segment(*self._rows_in(full_state, full_cache, segment_rows),
                                                                segment_rows)
            verdict, decode, draft_cache, prefilled = self.verify(model, decode, draft_cache, rows, drafts, q, segment)
            out = pack_output(verdict) if proposal is None else pack_output(verdict, proposal.tokens, self._confidence(
                proposal))
            full_state, full_cache = put_rows(full_state, decode, rows, batch), put_rows(full_cache, draft_cache, rows,
                                                                                         batch)
            if prefilled is not None:
                first, prompt_state, prompt_cache = prefilled
                first_out = pack_output(first)
                out = jnp.concatenate([out, jnp.pad(first_out, ((0, 0), (0, out.shape[1] - first_out.shape[1])))])
                full_state = put_rows(full_state, prompt_state, segment_rows, batch)
                full_cache = put_rows(full_cache, prompt_cache, segment_rows, batch)
            return out, full_state, full_cache
        return step

    def _confidence(self, proposal: dspark.Proposal) -> jax.Array:
        """The confidences a call returns: the drafter's, or the scripted acceptance (benchmarks)."""
        if self.scripted_acceptance is None:
            return proposal.confidence
        return jnp.full_like(proposal.confidence, self.scripted_acceptance)

    def propose(self, model, draft_cache, anchor, sampling: SlotSampling) -> dspark.Proposal:
        """The drafter's gamma tokens, their distributions q and confidences, with this step's noise."""
        noise = _exponentials(_keys(sampling, _DRAFT), (self.gamma, self.config.vocab_size))
        return dspark.propose(model, draft_cache, anchor, sampling.temperature, sampling.top_k, sampling.top_p, noise)

    def verify(self, model, decode, draft_cache, rows: Rows, drafts, q, segment: Segment | None = None):
        """Target extend over [anchor, drafts] (each row's first width + 1 count), exact rejection
        sampling at each row's width, commit, drafter context. -> (Verdict, decode, draft_cache, and for a
        prompt `segment` its prefill's (Verdict, state, draft cache), else None).
        A row with prompt_len > 0 extends over its prompt tokens instead, keeps them all and samples
        from p after the last (what a prefill call does for that chunk; the host reads the token only
        after a prompt's last chunk)."""
        k = drafts.shape[1]
        sampling, width, prompt = rows.sampling, jnp.clip(rows.width, 0, k), rows.prompt_len > 0
        ids = jnp.where(prompt[:, None], rows.prompt[:, :k + 1], jnp.concatenate([decode.anchor[:, None], drafts], 1))
        n_valid = jnp.where(prompt, jnp.minimum(rows.prompt_len, k + 1), jnp.where(rows.active, width + 1, 0))
        segments = [(ids, decode, n_valid)]
        if segment is not None:
            segments.append((segment.rows.prompt[:, :self.segment], segment.decode, segment.rows.prompt_len))
        extended = model.extend_segments(tuple(segments), self.feature_layers, (False, True)[:len(segments)])
        logits, features, decode = extended[0]
        keys = _keys(sampling, _VERIFY)
        uniforms = jax.vmap(lambda key: uniform_noise(jax.random.fold_in(key, 0), (self.gamma,)))(keys)[:, :k]
        noise = jax.vmap(lambda key: exponential_noise(jax.random.fold_in(key, 1), (self.config.vocab_size,)))(keys)
        verdict = rejection_sample(logits, q, drafts, uniforms, noise, sampling.temperature, sampling.top_k,
                                   sampling.top_p, width, implementation=self.implementation)
        if self.scripted_acceptance is not None:
            verdict = verdict._replace(n_accepted=scripted_accepted(uniforms, width, self.scripted_acceptance,
                                                                    verdict.invalid))
        first = self.first_token(last_rows(logits, n_valid), sampling)
        verdict = type(verdict)(*(jnp.where(prompt, a, b) for a, b in zip(first._replace(n_accepted=n_valid - 1),
                                                                           verdict)))
        n_keep = jnp.where(rows.active | prompt, verdict.n_accepted + 1, 0)
        decode = with_anchor(state.commit(decode, n_keep), verdict, rows.active | prompt)
        if draft_cache is not None:
            draft_cache = dspark.push_context(model, draft_cache, features, n_keep)
        prefilled = None if segment is None else self._prefilled(model, *extended[1], segment.draft_cache,
                                                                 segment.rows.prompt_len, segment.rows.sampling)
        return verdict, decode, draft_cache, prefilled
