"""`Generator`: the Python API over one engine — text or token ids in, a `Completion` or a stream of
text deltas out."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

from jdspark.assets import default_model_dir
from jdspark.checkpoint.loader import decode_at_load_by_default, load_model, read_config
from jdspark.config import EngineConfig
from jdspark.engine.engine import Engine, SpecOptions, checked_widths
from jdspark.engine.errors import EngineError
from jdspark.engine.options import RIDE_PROMPTS
from jdspark.engine.request import Completion, SamplingParams
from jdspark.model.model import Model
from jdspark.parallel.mesh import make_mesh
from jdspark.tokenizer.tokenizer import Tokenizer


class Generator:
    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @classmethod
    def from_model(cls, model: Model, tokenizer: Tokenizer | None = None, *, speculative: bool = True,
                   gamma: int | None = None, max_seq_len: int = 4096, max_batch: int = 1,
                   batch_buckets: tuple[int, ...] = (), prefill_chunk: int = 256, prefill_budget: int | None = None,
                   options: SpecOptions = SpecOptions(), implementation: str = "auto",
                   widths: tuple[int, ...] | None = None, prefill_buckets: tuple[int, ...] = (),
                   defer_steps: bool = False, ride_prompts: int = RIDE_PROMPTS, prompt_segment: int = 0) -> "Generator":
        """Compile an engine for `model`. `widths` to verify: default every width 0..gamma for the
        adaptive width, the one width of a fixed `options.width`; `batch_buckets`, `prefill_buckets`
        (`EngineConfig.prefill_batch_buckets`), `prefill_budget`, `defer_steps` (serve target-only
        while the step executables build in the background), `ride_prompts` (short prompts ride in
        the verify calls) and `prompt_segment` (a pending prompt's chunk of this many tokens in each verify
        call) as in `EngineConfig` and `Engine`."""
        config, widths = cls._settings(model.config, speculative=speculative, gamma=gamma, max_seq_len=max_seq_len,
                                       max_batch=max_batch, batch_buckets=batch_buckets, options=options, widths=widths,
                                       prefill_buckets=prefill_buckets, prompt_segment=prompt_segment,
                                       implementation=implementation)
        engine = Engine(model, config, tokenizer=tokenizer, speculative=speculative, prefill_chunk=prefill_chunk,
                        prefill_budget=prefill_budget, options=options, implementation=implementation, widths=widths,
                        defer_steps=defer_steps, ride_prompts=ride_prompts, prompt_segment=prompt_segment)
        return cls(engine)

    @staticmethod
    def _settings(model_config, *, speculative: bool, gamma: int | None, max_seq_len: int, max_batch: int,
                  batch_buckets: tuple[int, ...], prefill_buckets: tuple[int, ...], options: SpecOptions,
                  widths: tuple[int, ...] | None, prompt_segment: int, implementation: str,
                  **engine_only) -> tuple[EngineConfig, tuple[int, ...]]:
        """(the engine's config, the widths to compile) for a model of `model_config`, every option checked
        that needs no weights (`checked_widths`); `engine_only`: the options that only the engine reads. No
        defaults: `from_model`'s are the ones."""
        if gamma is None:
            gamma = model_config.dspark.block_size if model_config.dspark else 5
        if widths is None and speculative and options.width is not None:
            widths = (options.width,)
        config = EngineConfig(max_seq_len=max_seq_len, gamma=gamma, max_batch=max_batch, batch_buckets=batch_buckets,
                              prefill_batch_buckets=prefill_buckets)
        return config, checked_widths(model_config, config, speculative, widths, options, prompt_segment,
                                      implementation)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, speculative: bool = True, gamma: int | None = None,
                        dtype: str = "bfloat16", max_seq_len: int = 4096, tensor_parallel_size: int = 1,
                        expert_parallel_size: int = 1, gpu_memory: float | None = None,
                        pcie_share: float | None = None, dequantize: bool | None = None,
                        **engine_options) -> "Generator":
        """Load a checkpoint directory (config.json, safetensors, optional tokenizer.json); without
        a path, the embedded default model (`jdspark.assets`). With tensor_parallel_size x
        expert_parallel_size > 1 the model is sharded over that many devices (`jdspark.parallel`:
        heads, groups, vocabulary and expert width over tensor, routed experts over expert).
        `gpu_memory` (bytes of weights on the one GPU): the routed experts beyond it live in host
        banks, a share `pcie_share` of a call's host experts read by the GPU over PCIe, the rest
        computed by the CPU (`load_model`). `dequantize`: decode FP8 / FP4 weights at load (None: on a
        CPU backend for checkpoints of up to 1 GiB, where decoding them in every call costs more,
        `decode_at_load_by_default`; a GPU reads them in place)."""
        path = default_model_dir() if path is None else path
        # a bad option (or an unknown one's name) fails before the weights load, checked with from_model's defaults
        bound = inspect.signature(cls.from_model).bind(None, None, speculative=speculative, gamma=gamma,
                                                       max_seq_len=max_seq_len, **engine_options)
        bound.apply_defaults()
        cls._settings(read_config(path), **{k: v for k, v in bound.arguments.items() if k not in ("model", "tokenizer")})
        mesh = make_mesh(tensor_parallel_size, expert_parallel_size)
        if dequantize is None:
            dequantize = decode_at_load_by_default(path, mesh, gpu_memory)
        model = load_model(path, dtype=dtype, mesh=mesh, gpu_memory=gpu_memory, pcie_share=pcie_share,
                           dequantize=dequantize)
        tokenizer_file = Path(path) / "tokenizer.json"
        tokenizer = None
        if tokenizer_file.exists():
            tokenizer = Tokenizer(tokenizer_file, model.config.bos_token_id, model.config.eos_token_id)
        return cls.from_model(model, tokenizer, speculative=speculative, gamma=gamma, max_seq_len=max_seq_len,
                              **engine_options)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> Completion:
        """Run one request to the end."""
        run = self.run(prompt, params)
        for _ in run:
            pass
        return run.completion

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as blocks are accepted; they concatenate to `generate(...).text`."""
        yield from self.run(prompt, params)

    def run(self, prompt: str | list[int], params: SamplingParams | None = None) -> "Run":
        """Admit the request now; iterate the result for text deltas, then read `.completion`."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineError("a text prompt needs a tokenizer; this checkpoint has no tokenizer.json: "
                                  "pass a list of token ids instead")
            prompt = self.tokenizer.encode(prompt)
        return Run(self.engine, list(prompt), params)


class Run:
    """One request's generation as an iterator of text deltas; `completion` is set at the end. A
    run abandoned before its end (an exception, a closed generator) leaves the engine's slot free.
    Its end is where a library's engine is idle: step executables built in the background
    (`defer_steps`) are taken there (`Engine.poll`), not mid-request after `deferred.TAKE_WAIT_S`."""

    def __init__(self, engine: Engine, ids: list[int], params: SamplingParams):
        self.engine = engine
        self.completion: Completion | None = None
        self.first = engine.add(ids, params)  # the prefill's token

    def __iter__(self):
        delta, rid = self.first, self.first.request_id
        try:
            while True:
                if delta.text:
                    yield delta.text
                if delta.final:
                    self.completion = delta.completion
                    return
                deltas = self.engine.step()
                while rid not in deltas:  # an overlapped step reads the call issued the step before
                    if rid not in self.engine.running:
                        raise EngineError(f"request {rid} left the engine before its end (the engine was reset, or "
                                          "another reader took its last Delta)")
                    deltas = self.engine.step()
                delta = deltas[rid]
        finally:
            if self.completion is None:
                self.engine.cancel(rid)
            self.engine.poll()  # idle now unless other runs are in flight (then it waits)
