"""Compiled executables kept on disk whole, so a warm start-up neither traces nor compiles.

XLA's persistent compilation cache skips compilation, but not the Python tracing and lowering that
produce its key: on the CPU that was 10.4 of a 14.0 s warm start (docs/BENCHMARKS.md, serving).
Here a program's key is known before tracing (everything a trace depends on: the jdspark and
pallas_kernels sources, the jax version, the backend and its devices, XLA_FLAGS, the model graph and
parameter shapes, the engine's static settings, the program's name and its arguments' shapes,
dtypes and shardings), and the compiled executable is stored serialized under it
(`jax.experimental.serialize_executable`, the format the persistent cache stores).

On while the persistent compilation cache is (`enable_compile_cache`), in a `jdspark` folder inside
it (off with JDSPARK_STORE_EXECUTABLES=0). A file that fails to load is recompiled and rewritten;
programs with Python host callbacks (`jax.pure_callback`) are never stored (their callbacks are
objects of this process; the host experts' FFI custom call names its bank by a content key and is), nor, on the CPU, executables XLA's persistent cache handed back
(`ExecutableCache.compile`). The key cannot see code patched at run time (a test's monkeypatch):
such a caller turns the store off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import threading
from pathlib import Path

import jax
import jaxlib.version
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)
_PACKAGES = ("jdspark", "pallas_kernels")
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # the event jax records when its persistent cache answers
_this_thread = threading.local()


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT:
        _this_thread.cache_hit = True


@functools.cache
def _watch_cache_hits() -> None:
    """Listen for persistent-cache hits (once per process; the listener only sets a flag of the
    compiling thread)."""
    jax.monitoring.register_event_listener(_on_event)


@functools.cache
def source_digest() -> str:
    """sha256 over the source files of the packages a trace runs (a code change is a new key)."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        root = Path(__import__(package).__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".cc") and path.is_file():
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def environment() -> str:
    """What a compiled executable depends on besides the program: versions, devices, flags."""
    devices = jax.devices()
    return repr((jax.__version__, jaxlib.version.__version__, devices[0].client.platform_version,
                 jax.process_index(), [(d.id, d.device_kind) for d in devices], os.environ.get("XLA_FLAGS", ""),
                 jax.config.jax_default_matmul_precision, jax.config.jax_enable_x64, source_digest()))


def _arguments(args) -> str:
    leaves, treedef = jax.tree.flatten(args)
    return repr((str(treedef), [(a.shape, str(a.dtype), repr(a.sharding)) for a in leaves]))


def _self_contained(compiled: jax.stages.Compiled) -> bool:
    """Whether `compiled` survives serialization: no Python host callbacks or objects it keeps alive."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    return unloaded is not None and not getattr(unloaded, "host_callbacks", None) and not getattr(
        unloaded, "keepalive", None)


def twin(compiled: jax.stages.Compiled) -> jax.stages.Compiled:
    """A second loaded instance of `compiled` (serialized and loaded again: its own CUDA graphs) on the
    GPU; `compiled` itself elsewhere, or where it cannot be serialized (host callbacks)."""
    if jax.default_backend() != "gpu" or not _self_contained(compiled):
        return compiled
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    except Exception as error:  # noqa: BLE001 - e.g. out of memory loading it: run on the one instance
        log.warning("no twin for an executable (it runs alone): %s: %s", type(error).__name__, error)
        return compiled


class ExecutableCache:
    """Serialized executables in `root`, keyed by `static` (the caller's settings that shape every
    program) plus each program's name and arguments."""

    def __init__(self, root: str | os.PathLike, static: str):
        self.root = Path(root)
        self._static = hashlib.sha256((environment() + static).encode()).hexdigest()

    @classmethod
    def default(cls, static: str) -> ExecutableCache | None:
        """The cache inside the persistent compilation cache's folder; None while that is off, or
        with JDSPARK_STORE_EXECUTABLES=0 (for code patched at run time, which the key cannot see)."""
        folder = jax.config.jax_compilation_cache_dir
        if not folder or os.environ.get("JDSPARK_STORE_EXECUTABLES", "1") == "0":
            return None
        return cls(os.path.join(folder, "jdspark"), static)

    @staticmethod
    def compile(program: jax.stages.Lowered, options: dict | None = None) -> tuple[jax.stages.Compiled, bool]:
        """(compiled with XLA `options`, whether it may be stored). On the CPU not when XLA's persistent cache handed it
        back: XLA:CPU serializes such an executable without the functions it JIT-linked (measured:
        the stored copy loads, then fails with "Function wrapped_iota not found"). On the GPU a
        cache hit stores and reloads correctly (H200, 30 executables). Thread-safe: compilations
        run in parallel, and each thread sees only its own cache hits."""
        _watch_cache_hits()
        _this_thread.cache_hit = False
        compiled = program.compile(options or None)
        return compiled, not (_this_thread.cache_hit and jax.default_backend() == "cpu")

    def _path(self, name: str, args) -> Path:
        key = hashlib.sha256(f"{self._static}|{name}|{_arguments(args)}".encode()).hexdigest()
        return self.root / f"{key}.exe"

    def load(self, name: str, args, outputs) -> jax.stages.Compiled | None:
        """The stored executable of program `name` called with `args` (returning a pytree shaped like
        `outputs`), or None if there is none or it does not load."""
        path = self._path(name, args)
        if not path.exists():
            return None
        try:
            blob = path.read_bytes()
            return serialize_executable.deserialize_and_load(
                blob, jax.tree.structure((tuple(args), {})), jax.tree.structure(outputs))
        except Exception as error:  # a truncated or foreign file: compile again, then overwrite it
            log.warning("stored executable %s did not load (%s: %s); compiling it", path.name,
                        type(error).__name__, error)
            return None

    def save(self, name: str, args, compiled: jax.stages.Compiled) -> bool:
        """Store `compiled` (written whole, then renamed: readers never see part of a file). False if
        it cannot be stored (host callbacks, or a backend without serialization)."""
        if not _self_contained(compiled):
            return False
        try:
            blob, _, _ = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError, pickle.PicklingError, TypeError) as error:
            log.info("executable %s not stored: %s", name, error)
            return False
        path = self._path(name, args)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(blob)
        os.replace(partial, path)
        return True
