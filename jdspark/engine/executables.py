"""The engine's executables: its programs (`programs`) compiled ahead of time (JAX's counterpart of
CUDA graphs) per batch bucket and stored whole on disk, so the next start-up with the same model and
settings loads them instead of tracing and compiling (`exe_cache`).

Batch buckets: decode and step[k] (and, with a prompt segment, each of them with one) exist once per
batch size n in `EngineConfig.buckets`, prefill once per n in `EngineConfig.prefill_buckets` (by
default the same sizes). A call's n rows name their state slots (the `slot` input); the executable
gathers those rows of the one full-size decode state and draft cache, runs on them and scatters them
back (in place: both are donated). The largest bucket covers every slot in order and skips the
gather. Why a gather rather than compacting the slots: requests finish in any order, and moving a
finished request's neighbour would copy its whole state anyway; the gather copies only the n rows a
step runs, so a lone request on a 16-slot engine computes one row, and the state stays one array per
buffer (XLA still copies some full buffers around the write-back: `take_rows`).

One executable per engine step, one small array in and one out: each call costs host time on its
own (argument handling, launch), and each device-to-host read waits for the device. No input
depends on the call before: each call leaves the token it sampled in the state as the slot's next
anchor, so the engine can issue a step before it reads the one before (`Engine(overlap=True)`).
Per-slot inputs go in and results come out as one int32 array each (`calls`).

Kernels: `implementation` ("auto", "pallas", "xla"; `pallas_kernels.resolve_implementation`)
chooses the Pallas kernels or their jnp references for the whole program: the rejection sampler's
race and, through the model graph (`hyper.with_implementation`), the mHC Sinkhorn, the routed
experts and the FP8 linears ("auto" takes the last two only at real sizes, `KERNEL_MIN_WEIGHTS`).
Every executable donates the decode state and the draft cache.
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

from jdspark.config import EngineConfig
from jdspark.drafter import dspark
from jdspark.engine import compiling
from jdspark.engine.calls import slot_columns
from jdspark.engine.errors import EngineError
from jdspark.engine.exe_cache import ExecutableCache
from jdspark.engine.programs import Programs
from jdspark.engine.twins import Twins, twins_of
from jdspark.model import state
from jdspark.model.model import Model

log = logging.getLogger(__name__)


def enable_compile_cache(path: str | None = None) -> None:
    """Keep compiled executables on disk (default $JDSPARK_CACHE/xla, ~/.cache/jdspark/xla), so a
    restart with the same model and engine config skips compilation. Leaves a cache the caller
    already configured alone."""
    if jax.config.jax_compilation_cache_dir:
        return
    root = os.environ.get("JDSPARK_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jdspark"))
    jax.config.update("jax_compilation_cache_dir", path or os.path.join(root, "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


@dataclasses.dataclass
class Bucket:
    """The executables of one batch size."""

    prefill: jax.stages.Compiled | None = None
    decode: jax.stages.Compiled | None = None
    step: dict[int, jax.stages.Compiled] = dataclasses.field(default_factory=dict)
    with_prompt: dict[int | str, jax.stages.Compiled] = dataclasses.field(default_factory=dict)  # "decode" or k

    def program(self, name):
        """The executable named as `Executables.programs` keys it: "prefill", "decode", a width, or
        ("prompt", "decode" | a width): that call with a prompt segment."""
        if isinstance(name, tuple):
            return self.with_prompt[name[1]]
        return getattr(self, name) if name in ("prefill", "decode") else self.step[name]

    def put(self, name, program) -> None:
        if isinstance(name, tuple):
            self.with_prompt[name[1]] = program
        elif name in ("prefill", "decode"):
            setattr(self, name, program)
        else:
            self.step[name] = program

    def verify_call(self, width: int | None, with_prompt: bool):
        """The executable of a verify call of `width` (None: a plain decode), with a prompt segment or not."""
        if with_prompt:
            return self.with_prompt["decode" if width is None else width]
        return self.decode if width is None else self.step[width]


def check_segment(engine: EngineConfig, segment: int) -> None:
    """A prompt segment of `segment` tokens (0: none) fits `engine` (EngineError otherwise)."""
    if segment and (engine.max_batch < 2 or not engine.gamma + 1 <= segment <= engine.max_seq_len):
        raise EngineError(f"prompt_segment={segment}: needs max_batch >= 2 (a slot beside the running requests'; "
                          f"got {engine.max_batch}) and gamma + 1 = {engine.gamma + 1} to max_seq_len = "
                          f"{engine.max_seq_len} tokens (at least a verify row's prompt columns)")


class Executables(Programs):
    """AOT-compiled prefill, decode and step[k] (and with a prompt segment, decode and step[k] with one)
    per batch bucket, for one model, engine config, prefill chunk and prompt segment."""

    def __init__(self, model: Model, engine: EngineConfig, prefill_chunk: int, implementation: str,
                 widths: tuple[int, ...], pack_params: bool, segment: int = 0):
        """`widths`: the step[k] to compile (empty: a target-only engine, prefill and decode only);
        `implementation`: "auto", "pallas" or "xla" for every kernel (ValueError otherwise); `segment`: the
        prompt tokens a verify call may carry in a segment of its own (0: none; needs max_batch >= 2, a
        slot besides the verify rows')."""
        check_segment(engine, segment)
        super().__init__(model, engine, prefill_chunk, implementation, pack_params, segment)
        self.widths = widths
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
        verify = (1 + len(self.widths)) * (2 if self.segment else 1)  # decode, step[k], and each with a segment
        return len(self.prefill_sizes) + len(self.decode_sizes) * verify

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
        """{(bucket, "prefill" | "decode" | width | ("prompt", "decode" | width)): (function, example
        arguments)}: the executables `which` names (`compile`; a call with a prompt segment goes with its
        verify call's kind: "serving" holds the decode's, "steps" the step[k]s')."""
        if which not in ("all", "serving", "steps"):
            raise ValueError(f"which={which!r}: expected 'all', 'serving' or 'steps'")
        params, programs = self.params.arrays, {}
        serving, steps = which != "steps", which != "serving"
        for b in self.buckets:
            slots = jnp.zeros((b, slot_columns(self.gamma)), jnp.int32)
            if b in self.prefill_sizes and serving:
                ids = jnp.zeros((b, self.prefill_chunk), jnp.int32)
                programs[b, "prefill"] = self.prefill_function, (params, decode, draft_cache, ids,
                                                                 jnp.zeros((b,), jnp.int32), slots)
            if b not in self.decode_sizes:
                continue
            for k in ([None] if serving else []) + (list(self.widths) if steps else []):
                name = "decode" if k is None else k
                function = self.decode_function if k is None else self.step_function(k)
                programs[b, name] = function, (params, decode, draft_cache, slots)
                if self.segment:  # its slot inputs' column count (>= gamma + 2) keys it apart from the plain call
                    with_segment = jnp.zeros((b + 1, slot_columns(self.gamma, self.segment)), jnp.int32)
                    programs[b, ("prompt", name)] = self.verify_function(k, True), (params, decode, draft_cache,
                                                                                    with_segment)
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
