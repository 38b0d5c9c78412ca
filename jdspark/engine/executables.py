"""The compiled step functions of the engine, built ahead of time (JAX's counterpart of CUDA graphs)
and stored whole on disk, so the next start-up with the same model and settings loads them
instead of tracing and compiling (`exe_cache`).

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
  kept, the token after the last drawn as a prefill would draw it (`verify`).

Batch buckets: decode and step[k] exist once per batch size n in `EngineConfig.buckets`, prefill
once per n in `EngineConfig.prefill_buckets` (by default the same sizes). A call's n
rows name their state slots (the `slot` input); the executable gathers those rows of the one
full-size decode state and draft cache, runs on them and scatters them back (in place: both are
donated). The largest bucket covers every slot in order and skips the gather. Why a gather rather
than compacting the slots: requests finish in any order, and moving a finished request's
neighbour would copy its whole state anyway; the gather copies only the n rows a step runs, so a
lone request on a 16-slot engine computes one row, and the state stays one array per buffer (XLA
still copies some full buffers around the write-back: `take_rows`).

One executable per engine step, one small array in and one out: each call costs host time on its
own (argument handling, launch), and each device-to-host read waits for the device. No input
depends on the call before: each call leaves the token it sampled in the state as the slot's next
anchor, so the engine can issue a step before it reads the one before (`Engine(overlap=True)`).
Per-slot inputs go in and results come out as one int32 array each (`calls`).

Kernels: `implementation` ("auto", "pallas", "xla"; `pallas_kernels.resolve_implementation`)
chooses the Pallas kernels or their jnp references for the whole program: the rejection sampler's
race and, through the model graph (`hyper.with_implementation`), the mHC Sinkhorn, the routed
experts and the FP8 linears ("auto" takes the last two only at real sizes, `KERNEL_MIN_WEIGHTS`).

Every function takes the parameters as an argument (never baked in as constants; on the GPU packed
into a few buffers, `jdspark.engine.packed`, since each argument buffer costs host time per call),
donates the decode state and the draft cache, and draws its randomness on the device from per-slot
(seed, counter) keys, so a request's samples depend only on its own seed, step and width (the
uniforms are drawn gamma-long and sliced, so the executable's width does not change them). All
noise comes from `sampling.exponential_noise` / `sampling.uniform_noise`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import EngineConfig
from jdspark.drafter import dspark
from jdspark.engine import compiling, packed
from jdspark.engine.calls import (Rows, SlotSampling, pack_output, put_rows, slot_columns, take_rows, unpack_slots,
                                  with_anchor)
from jdspark.engine.exe_cache import ExecutableCache
from jdspark.engine.twins import Twins, twins_of
from jdspark.model import hyper, state
from jdspark.model.model import Model
from jdspark.speculative.sampling import exponential_noise, uniform_noise
from jdspark.speculative.verify import accepted_prefix, rejection_sample
from pallas_kernels import resolve_implementation

log = logging.getLogger(__name__)
_PREFILL, _DRAFT, _VERIFY = 1, 2, 3  # key purposes: independent streams per kind of draw
def enable_compile_cache(path: str | None = None) -> None:
    """Keep compiled executables on disk (default $JDSPARK_CACHE/xla, ~/.cache/jdspark/xla), so a
    restart with the same model and engine config skips compilation. Leaves a cache the caller
    already configured alone."""
    if jax.config.jax_compilation_cache_dir:
        return
    root = os.environ.get("JDSPARK_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jdspark"))
    jax.config.update("jax_compilation_cache_dir", path or os.path.join(root, "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


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


@dataclasses.dataclass
class Bucket:
    """The executables of one batch size."""

    prefill: jax.stages.Compiled | None = None
    decode: jax.stages.Compiled | None = None
    step: dict[int, jax.stages.Compiled] = dataclasses.field(default_factory=dict)

    def program(self, name):
        """The executable named as `Executables.programs` keys it: "prefill", "decode" or a width."""
        return getattr(self, name) if name in ("prefill", "decode") else self.step[name]

    def put(self, name, program) -> None:
        if name in ("prefill", "decode"):
            setattr(self, name, program)
        else:
            self.step[name] = program


class Executables:
    """AOT-compiled prefill, decode and step[k] per batch bucket, for one model, engine config and
    prefill chunk."""

    def __init__(self, model: Model, engine: EngineConfig, prefill_chunk: int, implementation: str,
                 widths: tuple[int, ...], pack_params: bool):
        """`widths`: the step[k] to compile (empty: a target-only engine, prefill and decode only);
        `implementation`: "auto", "pallas" or "xla" for every kernel (ValueError otherwise)."""
        resolve_implementation(implementation)  # validates it before anything is compiled
        self.implementation = implementation
        self.graphdef = hyper.with_implementation(model.graphdef, model.params, implementation)
        self.config, self.dtype = model.config, model.dtype
        # Pass `params.arrays` as every call's first argument.
        self.params = packed.PackedParams(model.params, packed.SMALL_BYTES if pack_params else None)
        self.dspark = model.config.dspark
        self.gamma = engine.gamma
        self.feature_layers = self.dspark.target_layer_ids if self.dspark else ()
        self.prefill_chunk = prefill_chunk
        self.widths = widths
        self.scripted_acceptance = engine.scripted_acceptance  # benchmarks only (EngineConfig)
        self.twins = engine.twin_executables
        if self.scripted_acceptance is not None:
            log.warning("scripted acceptance %.2f: drafts are accepted by script, not verified (benchmarks "
                        "only; the tokens are not the model's)", self.scripted_acceptance)
        # the prefill buckets: beside running requests the budget's rows, with none as many pending prompts
        # as fill a bucket (`batch.prompts_to_prefill`), and `Engine.add_many` every new one
        self.decode_sizes, self.prefill_sizes = engine.buckets, engine.prefill_buckets
        self.buckets = {n: Bucket() for n in sorted({*self.decode_sizes, *self.prefill_sizes})}
        self._parities = itertools.count(), itertools.count()  # the verify and decode calls', the prefills'
        self.lower_seconds = 0.0
        self.loaded = 0  # executables loaded from disk by `compile` (exe_cache; every call's together)
        self.from_workers = 0  # executables `compile` had compile workers build (`compiling`)
        self.worker_seconds = 0.0  # how long `compile` waited for them

    @property
    def largest(self) -> Bucket:
        """The bucket of every slot (what benchmarks of a full batch call; prefill, decode and step[k])."""
        return self.buckets[max(self.decode_sizes)]

    @property
    def prefill(self):
        return self.largest.prefill

    @property
    def decode(self):
        return self.largest.decode

    @property
    def step(self) -> dict[int, jax.stages.Compiled]:
        return self.largest.step

    @property
    def count(self) -> int:
        return len(self.prefill_sizes) + len(self.decode_sizes) * (1 + len(self.widths))  # prefill; decode, step[k]

    def compile(self, decode, draft_cache, which: str = "all") -> None:
        """Lower and compile the executables `which` names ("all"; "serving": prefill and decode; "steps":
        step[k]) for these (example) arguments' shapes.

        A float32 model's dot products are traced at true float32 precision: JAX's default computes
        them in TF32 on recent NVIDIA GPUs (10-bit mantissas), so a float32 model on the GPU would
        neither match the CPU nor keep greedy speculative output equal to greedy target-only output
        (rounding that depends on the verified width flips near-ties). A bfloat16 model keeps the
        default (its few float32 dots, e.g. the head, stay as measured in docs/BENCHMARKS.md)."""
        start = time.perf_counter()
        with self.precision():
            count, loaded, from_workers, worker_seconds, lower_seconds = self._compile(decode, draft_cache, which)
        self.loaded += loaded
        self.from_workers += from_workers
        self.worker_seconds += worker_seconds
        self.lower_seconds += lower_seconds
        log.info("%d executables (batch buckets %s, prefill %s%s) ready in %.1f s: %d loaded from disk, %d from compile "
                 "workers (%.1f s), %.1f s loading, tracing and lowering here", count, list(self.decode_sizes),
                 list(self.prefill_sizes), "" if which == "all" else f"; {which}",
                 time.perf_counter() - start, loaded, from_workers, worker_seconds, lower_seconds)

    def warm_up(self, decode, draft_cache, which: str = "all"):
        """Every executable of `which` (`compile`) called once (a twin twice: each instance once) on the example inputs it was
        compiled for, so that no served step pays an executable's first call: on the CPU a bucket-1
        prefill's first call took 169 ms against 16 after it (a 190 ms inter-token stall the first time
        a prompt was admitted beside running requests), on the GPU XLA records the call's CUDA graph.
        Returns the state and draft cache with every slot emptied, as at start."""
        for (b, name), (_, arguments) in self.programs(decode, draft_cache, which).items():
            program = self.buckets[b].program(name)
            for _ in range(2 if isinstance(program, Twins) else 1):
                _, decode, draft_cache = program(self.params.arrays, decode, draft_cache, *arguments[3:])
        every = jnp.ones(decode.batch, bool)
        decode = state.reset_slots(decode, every)
        draft_cache = None if draft_cache is None else dspark.reset_draft_slots(draft_cache, every)
        return jax.block_until_ready((decode, draft_cache))

    def precision(self):
        """The matmul precision every program is traced under (`compile`)."""
        full_float32 = self.dtype == jnp.float32
        return jax.default_matmul_precision("float32") if full_float32 else contextlib.nullcontext()

    def jit(self, function, decode, draft_cache):
        """`function` jitted as every engine call is: the state and draft cache donated, the outputs
        in the inputs' layout (on a mesh too), so a compiled step never sees another one."""
        def layout(tree):
            return jax.tree.map(lambda a: a.sharding, tree)

        # keep_unused: a donated input the program does not read (the state's `written`) would be dropped from
        # it, its output would get a new buffer every call, and the outputs of its shape would pair with
        # other inputs: state buffers moving between calls, each move an update of the call's CUDA graph
        return jax.jit(function, donate_argnums=(1, 2), keep_unused=True,
                       out_shardings=(decode.length.sharding, layout(decode), layout(draft_cache)))

    def programs(self, decode, draft_cache, which: str = "all") -> dict:
        """{(bucket, "prefill" | "decode" | width): (function, example arguments)}: the executables `which`
        names (`compile`)."""
        if which not in ("all", "serving", "steps"):
            raise ValueError(f"which={which!r}: expected 'all', 'serving' or 'steps'")
        params, programs = self.params.arrays, {}
        serving, steps = which != "steps", which != "serving"
        for b in self.buckets:
            slots = jnp.zeros((b, slot_columns(self.gamma)), jnp.int32)
            if b in self.prefill_sizes and serving:
                ids = jnp.zeros((b, self.prefill_chunk), jnp.int32)
                programs[b, "prefill"] = self._prefill, (params, decode, draft_cache, ids, jnp.zeros((b,), jnp.int32),
                                                         slots)
            if b in self.decode_sizes:
                if serving:
                    programs[b, "decode"] = self._decode, (params, decode, draft_cache, slots)
                for k in self.widths if steps else ():
                    programs[b, k] = self.step_function(k), (params, decode, draft_cache, slots)
        return programs

    def lowering(self, program, decode, draft_cache):
        """A function lowering `program` ((function, example arguments), an item of `programs`)."""
        function, arguments = program
        return functools.partial(self.jit(function, decode, draft_cache).lower, *arguments)

    def _compile(self, decode, draft_cache, which: str) -> tuple[int, int, int, float, float]:
        """Installs the executables of `which` in their buckets; returns how many, how many were loaded
        from disk and from compile workers, the wait for the workers and the loading, tracing and lowering
        in this process (serial, in Python)."""
        programs = self.programs(decode, draft_cache, which)
        store = ExecutableCache.default(self.static_key())
        outputs = (jnp.zeros(()), decode, draft_cache)
        start = time.perf_counter()
        arguments = {key: args for key, (_, args) in programs.items()}
        compiled = compiling.load_all(store, arguments, outputs)
        missing = [key for key in programs if compiled[key] is None]
        workers = compiling.workers(len(missing)) if store else 0
        worker_seconds, from_workers = 0.0, 0
        if workers and compiling.eligible(self, decode, draft_cache):
            begun = time.perf_counter()
            compiling.compile_in_workers(self, decode, draft_cache, missing, workers)
            worker_seconds = time.perf_counter() - begun
            compiled |= compiling.load_all(store, {key: arguments[key] for key in missing}, outputs)
            from_workers = sum(compiled[key] is not None for key in missing)
        lowerings = {key: self.lowering(programs[key], decode, draft_cache)
                     for key in programs if compiled[key] is None}
        loading = time.perf_counter() - start - worker_seconds
        fresh, lowering = compiling.compile_all(lowerings, store, arguments, compiling.compiler_options(self.config))
        compiled |= fresh
        for (b, name), program in (twins_of(compiled, *self._parities) if self.twins else compiled).items():
            self.buckets[b].put(name, program)
        loaded = len(programs) - len(lowerings) - from_workers
        return len(compiled), loaded, from_workers, worker_seconds, loading + lowering

    def static_key(self) -> str:
        """Everything the traced programs depend on besides their arguments (`exe_cache`)."""
        return repr((repr(self.graphdef), self.params.layout_key(), self.config, str(self.dtype), self.gamma,
                     self.implementation, self.feature_layers, self.scripted_acceptance))

    def module(self, arrays):
        """The model module over one call's parameter arrays (`params.arrays`), inside a trace."""
        return nnx.merge(self.graphdef, self.params.unpack(arrays))

    def _prefill(self, params, full_state, full_cache, ids, n_valid, slots):
        model = self.module(params)
        rows, batch = unpack_slots(slots), full_state.batch
        decode, draft_cache = self._rows_in(full_state, full_cache, rows)
        logits, features, decode = model.extend(ids, decode, n_valid, self.feature_layers)
        if draft_cache is not None:
            draft_cache = dspark.push_context(model, draft_cache, features, n_valid)
        verdict = self.first_token(logits, n_valid, rows.sampling)
        decode = with_anchor(decode, verdict, n_valid > 0)  # a prompt's last chunk leaves its first token
        return (pack_output(verdict), put_rows(full_state, decode, rows, batch),
                put_rows(full_cache, draft_cache, rows, batch))

    def first_token(self, logits, n_valid, sampling: SlotSampling):
        """A draw from p at each row's last real position (n_valid - 1): the token a prompt's last
        chunk samples (width 0: no drafts). Verdict with n_accepted 0."""
        last = jnp.take_along_axis(logits, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)
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

    def _decode(self, params, full_state, full_cache, slots):
        rows, batch = unpack_slots(slots), full_state.batch
        b = rows.slot.shape[0]
        no_drafts = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, self.config.vocab_size), jnp.float32)
        verdict, decode, draft_cache = self.verify(self.module(params), *self._rows_in(full_state, full_cache, rows),
                                                   rows, *no_drafts)
        return (pack_output(verdict), put_rows(full_state, decode, rows, batch),
                put_rows(full_cache, draft_cache, rows, batch))

    def step_function(self, k: int):
        """The (uncompiled) step[k]: propose gamma drafts, verify each row's first min(width, k)."""
        def step(params, full_state, full_cache, slots):
            model = self.module(params)
            rows, batch = unpack_slots(slots), full_state.batch
            decode, draft_cache = self._rows_in(full_state, full_cache, rows)
            proposal = self.propose(model, draft_cache, decode.anchor, rows.sampling)
            verdict, decode, draft_cache = self.verify(model, decode, draft_cache, rows, proposal.tokens[:, :k],
                                                       proposal.q[:, :k])
            confidence = proposal.confidence if self.scripted_acceptance is None else \
                jnp.full_like(proposal.confidence, self.scripted_acceptance)
            return (pack_output(verdict, proposal.tokens, confidence),
                    put_rows(full_state, decode, rows, batch), put_rows(full_cache, draft_cache, rows, batch))
        return step

    def propose(self, model, draft_cache, anchor, sampling: SlotSampling) -> dspark.Proposal:
        """The drafter's gamma tokens, their distributions q and confidences, with this step's noise."""
        noise = _exponentials(_keys(sampling, _DRAFT), (self.gamma, self.config.vocab_size))
        return dspark.propose(model, draft_cache, anchor, sampling.temperature, sampling.top_k, sampling.top_p, noise)

    def verify(self, model, decode, draft_cache, rows: Rows, drafts, q):
        """Target extend over [anchor, drafts] (each row's first width + 1 count), exact rejection
        sampling at each row's width, commit, drafter context. -> (Verdict, decode, draft_cache).
        A row with prompt_len > 0 extends over its prompt tokens instead, keeps them all and samples
        from p after the last (what a prefill call does for that chunk; the host reads the token only
        after a prompt's last chunk)."""
        k = drafts.shape[1]
        sampling, width, prompt = rows.sampling, jnp.clip(rows.width, 0, k), rows.prompt_len > 0
        ids = jnp.where(prompt[:, None], rows.prompt[:, :k + 1], jnp.concatenate([decode.anchor[:, None], drafts], 1))
        n_valid = jnp.where(prompt, jnp.minimum(rows.prompt_len, k + 1), jnp.where(rows.active, width + 1, 0))
        logits, features, decode = model.extend(ids, decode, n_valid, self.feature_layers)
        keys = _keys(sampling, _VERIFY)
        uniforms = jax.vmap(lambda key: uniform_noise(jax.random.fold_in(key, 0), (self.gamma,)))(keys)[:, :k]
        noise = jax.vmap(lambda key: exponential_noise(jax.random.fold_in(key, 1), (self.config.vocab_size,)))(keys)
        verdict = rejection_sample(logits, q, drafts, uniforms, noise, sampling.temperature, sampling.top_k,
                                   sampling.top_p, width, implementation=self.implementation)
        if self.scripted_acceptance is not None:
            verdict = verdict._replace(n_accepted=scripted_accepted(uniforms, width, self.scripted_acceptance,
                                                                    verdict.invalid))
        first = self.first_token(logits, n_valid, sampling)
        verdict = type(verdict)(*(jnp.where(prompt, a, b) for a, b in zip(first._replace(n_accepted=n_valid - 1),
                                                                           verdict)))
        n_keep = jnp.where(rows.active | prompt, verdict.n_accepted + 1, 0)
        decode = with_anchor(state.commit(decode, n_keep), verdict, rows.active | prompt)
        if draft_cache is not None:
            draft_cache = dspark.push_context(model, draft_cache, features, n_keep)
        return verdict, decode, draft_cache
