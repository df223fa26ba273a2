"""A process-isolated handle to a real ``sglang.Engine``.

Why a separate process: SGLang's Engine runs its scheduler(s) and detokenizer as child processes,
and when one of them dies SGLang's ``kill_process_tree`` kills the *parent* too. Hosting the Engine
in a dedicated child (its own session and process group) turns such a crash into an
:class:`EngineDiedError` in the caller; shutdown, timeout and crash all kill the whole group, so
no engine process outlives the handle.

The handle is shaped like ``sglang.Engine`` (token ids in, token ids out) so it can grow: every
request is a ``(method, args, kwargs)`` message over a pipe, see :meth:`SGLangEngine.call`.
Without CUDA it selects SGLang's CPU path (torch-native attention, pytorch sampling) and installs
the import stubs of :mod:`parallel.cpu.sglang_stubs` in the engine's processes.

Weight sync: :meth:`SGLangEngine.update_weights_direct` copies already-sharded tensors into each TP
rank's own parameters (one payload per rank, SGLang's ``load_format="direct"``) inside a
:meth:`SGLangEngine.weight_update` session; :meth:`SGLangEngine.rank_parameter_checksums` reads
back what every rank holds, hashed inside the scheduler processes.

Reproducible sampling: :meth:`SGLangEngine.reseed` puts every scheduler (TP rank) into the
sampling state of a freshly started engine whose ``random_seed`` is the given seed, so a resumed
run (new engine) samples the same tokens as an uninterrupted one. SGLang samples with each
scheduler's global RNGs (torch, plus python ``random``/numpy), seeded only once at startup; its
per-request ``sampling_seed`` needs ``enable_deterministic_inference``, which the CPU path
cannot use. The handle therefore adds a ``megarl_reseed`` method to SGLang's ``Scheduler`` class
in the scheduler processes (:func:`install_scheduler_patch`, run at interpreter start by the
``sitecustomize`` in :data:`parallel.cpu.sglang_stubs.SITE_DIR` when ``MEGARL_SGLANG_SCHEDULER_PATCH=1``;
SGLang spawns its schedulers, so a patch made in this process would not reach them) and calls it
on every rank with SGLang's ``Engine.collective_rpc``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

_PROJECT_ROOT = Path(__file__).resolve().parents[2]

# SGLang settings for its CPU path (see shared/notes/sglang_cpu.md); the caller's kwargs win.
CPU_ENGINE_DEFAULTS: dict[str, Any] = dict(
    device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
    disable_cuda_graph=True, mem_fraction_static=0.05, max_total_tokens=4096,
)


# Set in the engine's environment: its processes add ``Scheduler.megarl_reseed`` at import time.
SCHEDULER_PATCH_ENV_VAR = "MEGARL_SGLANG_SCHEDULER_PATCH"
RESEED_RPC = "megarl_reseed"  # the Scheduler method reseed() calls on every rank
# SGLang's model registry imports only this package's model classes (megarl's families) instead of
# every architecture it has; others still resolve (see megarl.rollout.sglang_models).
EXTERNAL_MODEL_PACKAGE_ENV_VAR = "SGLANG_EXTERNAL_MODEL_PACKAGE"
SGLANG_MODELS_PACKAGE = "megarl.rollout.sglang_models"


class EngineError(RuntimeError):
    """A request raised inside the engine process; the engine is still alive."""


class EngineDiedError(RuntimeError):
    """The engine process died (or never came up). ``exitcode`` and ``log_tail`` say why; ``pid``
    is the engine process (and process-group) id."""

    def __init__(self, message: str, exitcode: int | None = None, log_tail: str = "",
                 pid: int | None = None):
        super().__init__(f"{message}\n--- engine log (tail) ---\n{log_tail}" if log_tail else message)
        self.exitcode, self.log_tail, self.pid = exitcode, log_tail, pid


class EngineTimeoutError(EngineDiedError, TimeoutError):
    """A call did not answer in time; the engine was killed (its state is unknown)."""


def cpu_threads_bind(tp_size: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp_size`` ranks: this process's cores split into
    ``tp_size`` groups ("0|1" for TP=2 on two cores); cores are shared when there are too few."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp_size:
        groups = [[cpus[r % len(cpus)]] for r in range(tp_size)]
    else:
        per = len(cpus) // tp_size
        groups = [cpus[r * per:(r + 1) * per] for r in range(tp_size)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 and g[-1] - g[0] == len(g) - 1 else ",".join(map(str, g))
                    for g in groups)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def serialize_rank_tensors(tensors: dict[str, Any]) -> bytes:
    """One TP rank's ``{name: tensor}`` as the payload SGLang's ``update_weights_from_tensor``
    decodes (with its whitelisting unpickler) in that rank's scheduler.

    CPU tensors are pickled with their data inline (plain pickle; each tensor is first made to own
    exactly its bytes, so a slice never drags its base tensor's whole storage along): the payload
    is self-contained and needs no shared memory or fd passing, which across the handle's process
    boundary would fail (multiprocessing's fd sharer authenticates with a per-process-tree key).
    SGLang's ``monkey_patch_torch_reductions`` is NOT applied: after it, CPU tensors no longer
    serialize with multiprocessing's pickler (plain pickle is unaffected). CUDA tensors go as CUDA
    IPC handles, the way SGLang's own Engine serializes them (its serializer, after its reductions
    patch); that path needs a GPU and has not been run yet.
    """
    items = _payload_items(tensors)
    devices = {t.device.type for _, t in items}
    if devices <= {"cpu"}:
        own = [(n, t if t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone())
               for n, t in items]
        return pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL)
    if devices == {"cuda"}:
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        return MultiprocessingSerializer.serialize(items)
    raise ValueError(f"update payload mixes or uses unsupported devices {sorted(devices)}")


class SharedMemoryStaging:
    """Per-TP-rank CPU staging buffers in shared memory, reused by every weight update of an engine
    on this host (the handle's engine always is). A rank's tensors are copied into its buffer and
    the payload names the buffer (torch's ``file_system`` sharing: a few KB, rebuilt by SGLang's
    whitelisted ``rebuild_storage_filename``) instead of carrying the bytes, which saves three
    copies (the handle's pipe, SGLang's zmq hop, the unpickling) per update: 88 MB went from
    0.6 s to 0.1 s here. The schedulers copy out of the buffer before the update call returns,
    so the next update may overwrite it. When /dev/shm cannot hold a buffer, ``payload`` returns
    None and the caller sends the bytes inline (:func:`serialize_rank_tensors`).

    A trainer process on the engine's host can write its shards straight into such a buffer
    (:meth:`views`, then :meth:`named`): tensors already in shared memory are named as they are,
    never copied again."""

    ALIGN = 64  # bytes; every tensor starts at a multiple (any dtype's alignment)

    def __init__(self):
        self._buffers: dict[int, Any] = {}  # rank -> flat uint8 tensor in shared memory

    @classmethod
    def _aligned(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def views(self, rank: int, layout: dict[str, tuple]) -> dict[str, Any] | None:
        """Rank ``rank``'s buffer carved into one tensor per ``name: (shape, dtype)`` (grown when
        too small; its contents are not kept then); None when /dev/shm cannot hold it."""
        import shutil

        import torch

        sizes = {name: torch.Size(shape).numel() * dtype.itemsize for name, (shape, dtype) in layout.items()}
        need = sum(self._aligned(n) for n in sizes.values())
        buffer = self._buffers.get(rank)
        if buffer is None or buffer.numel() < need:
            self._buffers.pop(rank, None)
            try:
                free = shutil.disk_usage("/dev/shm").free
            except OSError:
                return None
            if free < need * 1.25:
                return None
            with _file_system_sharing():  # a named segment any local process can map
                buffer = self._buffers[rank] = torch.empty(need, dtype=torch.uint8).share_memory_()
        views, offset = {}, 0
        for name, (shape, dtype) in layout.items():
            views[name] = buffer[offset: offset + sizes[name]].view(dtype).view(shape)
            offset += self._aligned(sizes[name])
        return views

    @staticmethod
    def named(tensors: dict[str, Any]) -> bytes:
        """The payload of tensors that live in shared memory: their names and buffers, no bytes."""
        import io
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing.reductions  # noqa: F401 - registers the tensor reducers

        out = io.BytesIO()
        with _file_system_sharing():
            ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(_payload_items(tensors))
        return out.getvalue()

    def payload(self, rank: int, tensors: dict[str, Any]) -> bytes | None:
        items = _payload_items(tensors)
        if any(t.device.type != "cpu" for _, t in items):
            return None
        if items and all(t.is_shared() for _, t in items):  # e.g. a trainer's staged shards
            return self.named(dict(items))
        views = self.views(rank, {name: (t.shape, t.dtype) for name, t in items})
        if views is None:
            return None
        for name, tensor in items:
            views[name].copy_(tensor)
        return self.named(views)

    def close(self) -> None:
        self._buffers.clear()


@contextlib.contextmanager
def _file_system_sharing():
    """torch's ``file_system`` sharing strategy for the block: tensors shared or pickled in it are
    named segments that any local process maps by name (the default, file descriptors, needs
    the receiver to be a child of the sender's multiprocessing tree)."""
    import torch.multiprocessing as torch_mp

    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(previous)


def staged_tensors(payload: bytes) -> dict[str, Any]:
    """The tensors a :meth:`SharedMemoryStaging.named` payload names, mapped in this process."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401 - registers the tensor rebuilders

    return dict(ForkingPickler.loads(payload))


def _payload_items(tensors: dict[str, Any]) -> list:
    import torch

    items = []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update payload entries must be str -> torch.Tensor, got {name!r} -> "
                            f"{type(tensor).__name__}")
        items.append((name, tensor.detach()))
    return items


def weight_checksum(tensor) -> str:
    """The parity probe's checksum of one tensor: :func:`parallel.checkpoint.hf_io.tensor_checksum` with
    xxh3-128. The trainer hashes what it sends with it, and SGLang's weight checker hashes what
    each engine rank holds with it (:func:`install_scheduler_patch` puts it in place of the
    checker's own hash, a sha256 on CPU: 88 MB took 84 ms there against 12 ms here, on each side
    of every sync)."""
    import xxhash

    from parallel.checkpoint.hf_io import tensor_checksum

    return tensor_checksum(tensor, xxhash.xxh3_128)


class SGLangEngine:
    """A real ``sglang.Engine`` living in its own process group.

    ``model_path``/``tp_size``/``dtype`` and ``engine_kwargs`` go to ``sglang.Engine`` unchanged;
    ``mem_fraction_static``/``max_total_tokens`` default to small values on CPU and to SGLang's own
    on GPU. Input is token ids (``skip_tokenizer_init=True`` unless overridden). Every call waits at
    most ``call_timeout_s``; startup at most ``startup_timeout_s``. One request at a time (not
    thread-safe). The engine's output goes to ``log_path`` (a temporary file by default).
    """

    def __init__(self, model_path: str, tp_size: int = 1, dtype: str = "float32", *,
                 mem_fraction_static: float | None = None, max_total_tokens: int | None = None,
                 device: str | None = None, startup_timeout_s: float = 300.0,
                 call_timeout_s: float = 300.0, log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, **engine_kwargs: Any):
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device, self.tp_size, self.call_timeout_s = device, tp_size, call_timeout_s
        # sleep_on_idle: an idle scheduler otherwise busy-polls its sockets (measured: 0.64 CPU
        # cores per idle CPU engine, 0.007 with it), stealing the CPU that colocated training uses.
        kwargs: dict[str, Any] = dict(model_path=str(model_path), tp_size=tp_size, dtype=dtype,
                                      skip_tokenizer_init=True, sleep_on_idle=True)
        from parallel.cpu.sglang_stubs import SITE_DIR

        child_env = dict(os.environ)
        if device == "cpu":
            from parallel.cpu.sglang_stubs import child_env as stub_env

            kwargs.update(CPU_ENGINE_DEFAULTS)
            child_env = stub_env(child_env)
            child_env["SGLANG_USE_CPU_ENGINE"] = "1"
            # SGLang's @torch.compile'd helpers (e.g. the vocab embedding's mask at TP > 1) would be
            # compiled to C++ by inductor on each scheduler's first request: a tiny TP=2 engine's
            # first generate took 38-55 s, each later one under 1 s. Eager, they are a few ops.
            child_env.setdefault("TORCHDYNAMO_DISABLE", "1")
            if tp_size > 1:  # one NUMA node cannot host several ranks without an explicit bind
                child_env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_threads_bind(tp_size))
        # The sitecustomize in SITE_DIR installs the scheduler patch (reseed) on every device and
        # the CPU stubs only where MEGARL_CPU_STUBS=1 (set above for CPU engines).
        front = [str(SITE_DIR), str(_PROJECT_ROOT)]
        child_env["PYTHONPATH"] = os.pathsep.join(
            front + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in front])
        child_env[SCHEDULER_PATCH_ENV_VAR] = "1"
        child_env.setdefault(EXTERNAL_MODEL_PACKAGE_ENV_VAR, SGLANG_MODELS_PACKAGE)
        child_env.update(env or {})
        if mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = mem_fraction_static
        if max_total_tokens is not None:
            kwargs["max_total_tokens"] = max_total_tokens
        kwargs.update(engine_kwargs, device=device)
        self.engine_kwargs = kwargs

        self._own_log = log_path is None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="megarl-sglang-", suffix=".log")
            os.close(fd)
        self.log_path = str(log_path)
        parent_sock, child_sock = socket.socketpair()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from megarl.rollout.sglang_engine import _child_main; _child_main()",
                 str(child_sock.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                pass_fds=(child_sock.fileno(),), start_new_session=True, cwd=str(_PROJECT_ROOT))
        child_sock.close()
        self.pid = self._proc.pid  # also the process-group id of every engine process
        self._conn = Connection(parent_sock.detach())
        self._finalizer = weakref.finalize(self, _kill_group, self.pid)
        self._closed = False
        self._weight_update_open = False  # between begin_weight_update and end_weight_update
        self._parameter_names: list[frozenset[str]] | None = None
        self._staging = SharedMemoryStaging()
        self._conn.send(kwargs)
        self.info = self._wait_reply(startup_timeout_s, "startup")

    # ------------------------------------------------------------------ requests

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run ``engine.<method>(*args, **kwargs)`` in the engine process and return its (picklable)
        result; methods with a helper in ``_HELPERS`` run that instead."""
        if self._closed:
            raise EngineDiedError(f"SGLang engine (pid {self.pid}) was shut down; cannot call {method}",
                                  self._proc.returncode, pid=self.pid)
        try:
            self._conn.send((method, args, kwargs))
        except OSError:
            pass  # the engine is gone: _wait_reply reports how
        try:
            return self._wait_reply(self.call_timeout_s if timeout_s is None else timeout_s, method)
        except (EngineError, EngineDiedError):
            raise
        except BaseException:  # e.g. Ctrl-C mid-request: a late reply would desynchronise the pipe
            self._kill()
            raise

    def generate(self, input_ids: list[list[int]], sampling_params: dict | list[dict],
                 return_logprob: bool = False, timeout_s: float | None = None) -> list[dict]:
        """One dict per prompt: ``output_ids``, ``finish_reason``, ``cached_tokens`` (prompt tokens
        whose KV came from the prefix cache) and, with ``return_logprob``, ``output_logprobs``
        (log-prob of each output token)."""
        return self.call("generate", input_ids, sampling_params, return_logprob, timeout_s=timeout_s)

    def reseed(self, seed: int, timeout_s: float | None = None) -> None:
        """Put every scheduler (TP rank) into the sampling state of a freshly started engine with
        ``random_seed=seed``: re-seed its RNGs (torch CPU and accelerator, python ``random``,
        numpy: SGLang's own ``set_random_seed``, the call it makes at startup) and flush its prefix
        cache (scheduling order depends on cached prefixes; a fresh engine has none) and reset
        its admission estimate (``new_token_ratio``), all while no request runs.

        From then on the same sequence of :meth:`generate` calls with the same weights and
        settings samples the same tokens (and log-probs) on this engine as on a fresh one.
        That holds because each ``generate`` reaches the scheduler as ONE message (a list of
        token-id prompts, batch size 1 or more, ``n`` unset or 1) and is scheduled without
        regard to timing; SGLang sends the requests of a call with ``n > 1`` one by one, which
        makes batch formation, and so the tokens, timing dependent: repeat prompts instead.
        Raises :class:`EngineError` when a scheduler refused (e.g. requests still in flight).
        """
        value = None if isinstance(seed, bool) or not hasattr(seed, "__index__") else seed.__index__()
        if value is None or not 0 <= value < 2**32:
            raise ValueError(f"reseed: seed must be an integer in [0, 2**32) (numpy's seed range), "
                             f"got {seed!r}")
        self.call("reseed", value, timeout_s=timeout_s)

    # ------------------------------------------------------------------ weights
    # SGLang (0.5.23) refuses update_weights_from_* outside a begin/end weight-update session.

    def begin_weight_update(self, timeout_s: float | None = None) -> None:
        """Open a weight-update session (SGLang pauses nothing: call it when no request runs)."""
        self.call("begin_weight_update", timeout_s=timeout_s)
        self._weight_update_open = True

    def end_weight_update(self, timeout_s: float | None = None) -> None:
        """Close the session opened by :meth:`begin_weight_update`."""
        self.call("end_weight_update", timeout_s=timeout_s)
        self._weight_update_open = False

    @contextlib.contextmanager
    def weight_update(self, timeout_s: float | None = None):
        """``with engine.weight_update(): engine.update_weights_direct(...)`` (one or more buckets);
        the session is closed even if an update raises (unless the engine died)."""
        self.begin_weight_update(timeout_s=timeout_s)
        try:
            yield self
        finally:
            if not self._closed:
                self.end_weight_update(timeout_s=timeout_s)

    def update_weights_direct(self, per_rank: list[dict[str, Any]], flush_cache: bool = True,
                              timeout_s: float | None = None, via_shared_memory: bool = True) -> None:
        """Copy already-sharded tensors into each TP rank's parameters, in place.

        ``per_rank[r]`` maps SGLang parameter names of TP rank ``r`` (``named_parameters()`` of its
        model, e.g. ``model.layers.0.self_attn.qkv_proj.weight``) to that rank's full local tensor
        (same shape and dtype as the parameter); a bucket may name any subset of the parameters.
        Delivered with SGLang's ``update_weights_from_tensor(load_format="direct")``: one payload
        per rank, each rank decodes only its own (:func:`serialize_rank_tensors`). Must run
        inside :meth:`weight_update`. ``flush_cache`` flushes SGLang's prefix cache after the
        load (pass False for all but the last bucket).
        CPU tensors travel through this handle's shared-memory staging buffers
        (:class:`SharedMemoryStaging`) unless ``via_shared_memory=False`` or /dev/shm is too small;
        then their bytes go inline.

        SGLang's direct loader checks nothing before copying, and a bad entry kills the engine
        (the scheduler dies: :class:`EngineDiedError`). Names are checked here first against
        :meth:`rank_parameter_names` (ValueError, engine unharmed); shapes and dtypes are the
        caller's plan's to get right (a mismatch is an assertion in the scheduler).
        """
        if not self._weight_update_open:
            raise RuntimeError("update_weights_direct must run inside engine.weight_update() "
                               "(SGLang refuses weight updates outside a begin/end session)")
        if len(per_rank) != self.tp_size:
            raise ValueError(f"update_weights_direct got {len(per_rank)} per-rank dicts for an engine "
                             f"with tp_size={self.tp_size}: pass exactly one dict per TP rank")
        for rank, (tensors, known) in enumerate(zip(per_rank, self.rank_parameter_names())):
            unknown = sorted(set(tensors) - known)
            if unknown:
                raise ValueError(f"update_weights_direct: TP rank {rank} has no parameter(s) {unknown[:5]}"
                                 f"{' ...' if len(unknown) > 5 else ''}; its parameters are SGLang's "
                                 f"names, e.g. {sorted(known)[:3]}")
        payloads = [(self._staging.payload(rank, tensors) if via_shared_memory else None)
                    or serialize_rank_tensors(tensors) for rank, tensors in enumerate(per_rank)]
        self.call("update_weights_from_payloads", payloads, "direct", flush_cache, timeout_s=timeout_s)

    def get_weights_by_name(self, name: str, truncate_size: int = 100,
                            timeout_s: float | None = None) -> list | None:
        """SGLang's ``get_weights_by_name``: TP rank 0's first ``truncate_size`` rows of a parameter
        as nested lists (HF names accepted for fused parameters; at TP>1 SGLang all-gathers
        ``o_proj``/``down_proj`` columns). A debugging probe, not a per-rank view."""
        return self.call("get_weights_by_name", name, truncate_size, timeout_s=timeout_s)

    def flush_cache(self, timeout_s: float | None = None) -> bool:
        """Flush SGLang's prefix (radix) cache; False when SGLang refused (requests in flight)."""
        return self.call("flush_cache", timeout_s=timeout_s)

    def rank_parameter_names(self) -> list[frozenset[str]]:
        """Per TP rank, the names :meth:`update_weights_direct` accepts (SGLang's parameter names).
        Read once per engine, from :meth:`rank_parameter_checksums`."""
        if self._parameter_names is None:
            self._parameter_names = [frozenset(c) for c in self.rank_parameter_checksums()]
        return self._parameter_names

    def rank_parameter_checksums(self, timeout_s: float | None = None) -> list[dict[str, str]]:
        """Per TP rank (index = rank), ``{name: checksum}`` of every parameter (and persistent
        buffer), computed inside each scheduler process by SGLang's own weight checker
        (``check_weights(action="checksum")``) with :func:`weight_checksum` as its hash.
        """
        return self.call("rank_parameter_checksums", timeout_s=timeout_s)

    def _wait_reply(self, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._conn.poll(0.2):
                    status, payload = self._conn.recv()
                    break
            except (EOFError, OSError):
                raise self._died(what) from None
            if self._proc.poll() is not None and not self._conn.poll(0):
                raise self._died(what)
            if time.monotonic() > deadline:
                raise self._fail(EngineTimeoutError, f"SGLang engine (pid {self.pid}) did not answer "
                                 f"{what} within {timeout_s:.0f} s; killed it", None)
        if status == "ok":
            return payload
        if status == "fatal":  # the child reported the error and exits
            raise self._fail(EngineDiedError, f"SGLang engine (pid {self.pid}) failed during {what}:\n{payload}")
        raise EngineError(f"SGLang engine {what} raised:\n{payload}")

    def _died(self, what: str) -> EngineDiedError:
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        how = f"exit code {code}" + (f" ({signal.Signals(-code).name})" if code and code < 0 else "")
        return self._fail(EngineDiedError, f"SGLang engine process (pid {self.pid}) died during {what}: {how}",
                          code)

    def _fail(self, cls: type[EngineDiedError], message: str, code: int | None | str = "auto"):
        """Kill the engine and build the error to raise, with the tail of its log (a log file the
        handle created is removed: the tail is in the error)."""
        self._kill()
        tail = self._log_tail()
        if self._own_log:
            Path(self.log_path).unlink(missing_ok=True)
        return cls(message, self._proc.returncode if code == "auto" else code, tail, self.pid)

    def _log_tail(self, n_lines: int = 40) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n_lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ teardown

    def _kill(self) -> None:
        """SIGKILL every process of the engine's group (scheduler/detokenizer included)."""
        self._closed = True
        import psutil

        try:  # descendants that might have left the group are killed by pid
            extra = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:  # the engine process is gone already (e.g. SGLang killed it)
            extra = []
        # Group members outlive the engine process when it died first (orphans): wait for them too.
        extra += [p for p in psutil.process_iter() if _pgid(p.pid) == self.pid and p.pid != self.pid]
        _kill_group(self.pid)
        for proc in extra:
            try:
                proc.kill()
            except psutil.Error:
                pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        for proc in extra:  # orphans are reaped by init: a zombie counts as gone
            while time.monotonic() < deadline:
                try:
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.Error:
                    break
                time.sleep(0.05)
        self._conn.close()
        self._finalizer.detach()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the engine to shut down, then kill whatever is left of its process group."""
        if self._closed:
            return
        try:
            self._conn.send(("__shutdown__", (), {}))
            self._proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill()
        self._staging.close()
        if self._own_log:
            Path(self.log_path).unlink(missing_ok=True)

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# ---------------------------------------------------------------------- scheduler process side
# Runs in SGLang's scheduler processes (and, inert, in every other process of the engine).

_SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
_WEIGHT_CHECKER_MODULE = "sglang.srt.utils.weight_checker"
_RESEED_BUSY = "megarl_reseed: scheduler not idle"


def _scheduler_reseed(self, seed: int) -> None:
    """``Scheduler.megarl_reseed``: the sampling state of a fresh engine with ``random_seed=seed``
    (see :meth:`SGLangEngine.reseed`). Refuses while requests run."""
    from sglang.srt.utils.common import set_random_seed

    # False while requests are queued or running; then nothing changed. empty_cache=False: on CPU
    # it is a full gc.collect() of the scheduler's heap (~0.3 s here), on GPUs a CUDA cache release;
    # neither changes what is sampled.
    if not self.flush_cache(empty_cache=False):
        raise RuntimeError(f"{_RESEED_BUSY} (requests queued or running)")
    self.new_token_ratio_tracker.reset()  # what an idle scheduler resets; fresh engines start there
    set_random_seed(seed)  # python random, numpy, torch (CPU and every accelerator): as at startup
    self.random_seed = seed


def _patch_scheduler_module(module) -> None:
    scheduler = getattr(module, "Scheduler", None)
    if scheduler is None:  # a future SGLang moved it: reseed() will say the method is missing
        print(f"megarl: {module.__name__} has no Scheduler class; {RESEED_RPC} not installed",
              file=sys.stderr, flush=True)
        return
    setattr(scheduler, RESEED_RPC, _scheduler_reseed)


def _patch_weight_checker_module(module) -> None:
    """SGLang's weight checker hashes with :func:`weight_checksum` (what the trainer computes)."""
    if not hasattr(module, "_hash_tensor"):  # a future SGLang renamed it: every parity probe fails, loudly
        print(f"megarl: {module.__name__} has no _hash_tensor; weight checksums left as SGLang computes them",
              file=sys.stderr, flush=True)
        return
    module._hash_tensor = weight_checksum


class _PostImportPatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for one module it asks the finders after it for the spec and wraps
    the loader's ``exec_module`` so the module is patched right after it executes. Removes itself
    once used."""

    def __init__(self, fullname: str, patch):
        self.fullname, self.patch = fullname, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.fullname or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # one-shot; also keeps the lookup below from finding us
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # this spec's own loader instance
        return spec


def install_scheduler_patch() -> None:
    """Add ``Scheduler.megarl_reseed`` (:func:`_scheduler_reseed`) to SGLang's scheduler class,
    hash with :func:`weight_checksum` in SGLang's weight checker, batch the torch-native backend's
    attention (:mod:`megarl.rollout.batched_attention`), sample
    by inverse CDF (:mod:`megarl.rollout.inverse_cdf_sampling`) and run fp32 CPU linears through
    oneDNN (:mod:`parallel.cpu.linear`) in this process: now for a module
    imported already, otherwise right after its import. Run at interpreter start (before SGLang
    is imported) in every process of an engine by the ``sitecustomize`` in
    ``parallel/cpu/sglang_stubs/site`` when ``MEGARL_SGLANG_SCHEDULER_PATCH=1``.
    Also keeps megatron out of the process: SGLang's debug dumper imports ``megatron.core`` when it
    is installed (for a plugin used inside Megatron training processes, never in an engine) and
    reads its absence as "not installed": ~2 s of CPU less per engine start.
    Imports nothing of SGLang itself. Idempotent."""
    sys.modules.setdefault("megatron", None)  # "import megatron..." raises ModuleNotFoundError
    from megarl.rollout.batched_attention import BACKEND_MODULE, patch_backend_module
    from megarl.rollout.inverse_cdf_sampling import SAMPLER_MODULE, patch_sampler_module
    from parallel.cpu.linear import SGLANG_UNQUANT_MODULE, patch_sglang_unquant_module

    for name, patch in ((_SCHEDULER_MODULE, _patch_scheduler_module),
                        (_WEIGHT_CHECKER_MODULE, _patch_weight_checker_module), (BACKEND_MODULE, patch_backend_module),
                        (SAMPLER_MODULE, patch_sampler_module),
                        (SGLANG_UNQUANT_MODULE, patch_sglang_unquant_module)):
        if name in sys.modules:
            patch(sys.modules[name])
        elif not any(isinstance(f, _PostImportPatch) and f.fullname == name for f in sys.meta_path):
            sys.meta_path.insert(0, _PostImportPatch(name, patch))


# ---------------------------------------------------------------------- engine process side


def _do_generate(engine, input_ids, sampling_params, return_logprob):
    outs = engine.generate(input_ids=input_ids, sampling_params=sampling_params,
                           return_logprob=return_logprob)
    results = []
    for out in [outs] if isinstance(outs, dict) else outs:
        meta = out["meta_info"]
        res = {"output_ids": list(out["output_ids"]), "finish_reason": meta.get("finish_reason"),
               "cached_tokens": int(meta.get("cached_tokens", 0))}
        if return_logprob:
            res["output_logprobs"] = [float(lp) for lp, *_ in meta["output_token_logprobs"]]
        results.append(res)
    return results


def _checked(result, what: str):
    """SGLang's session/update calls answer ``(success, message)``; raise on failure."""
    success, message = result[0], result[1]
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")
    return message


def _do_begin_weight_update(engine):
    _checked(engine.begin_weight_update(), "begin_weight_update")


def _do_end_weight_update(engine):
    _checked(engine.end_weight_update(), "end_weight_update")


def _do_update_weights_from_payloads(engine, payloads: list[bytes], load_format: str | None,
                                     flush_cache: bool):
    """SGLang's Engine.update_weights_from_tensor serializes ONE tensor list for every rank; per-rank
    tensors need the request built by hand: ``serialized_named_tensors[r]`` is rank r's payload."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=load_format,
                                          flush_cache=flush_cache)
    _checked(engine.loop.run_until_complete(engine.tokenizer_manager.update_weights_from_tensor(obj, None)),
             f"update_weights_from_tensor(load_format={load_format!r})")


def _do_reseed(engine, seed: int, busy_retry_s: float = 10.0):
    """``Scheduler.megarl_reseed(seed)`` on every rank. A scheduler that has just sent the last
    output of a call may still hold the finished batch for one loop iteration and refuse (busy):
    retry for a while."""
    deadline = time.monotonic() + busy_retry_s
    while True:
        try:
            engine.collective_rpc(RESEED_RPC, seed=seed)
            return
        except AssertionError as err:  # collective_rpc asserts the schedulers' success
            message = str(err)
        if _RESEED_BUSY in message and time.monotonic() < deadline:
            time.sleep(0.05)
            continue
        hint = ""
        if RESEED_RPC in message and "attribute" in message:
            hint = (f"\n(the schedulers lack {RESEED_RPC}: they must start with "
                    f"{SCHEDULER_PATCH_ENV_VAR}=1 and parallel/cpu/sglang_stubs/site on PYTHONPATH, as "
                    f"SGLangEngine arranges; see install_scheduler_patch)")
        raise RuntimeError(f"SGLang schedulers refused {RESEED_RPC}(seed={seed}): {message}{hint}")


def _do_flush_cache(engine):
    return bool(engine.flush_cache().success)


def _do_rank_parameter_checksums(engine):
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    success, message, ranks, _ = engine.loop.run_until_complete(
        engine.tokenizer_manager.check_weights(CheckWeightsReqInput(action="checksum"), None))
    if not success or ranks is None:
        raise RuntimeError(f"SGLang check_weights(checksum) failed: {message}")
    by_rank = {info["parallelism_info"][0]["tp_rank"]: info["checksums"] for info in ranks}
    return [by_rank[r] for r in sorted(by_rank)]


# methods whose arguments/results the handle reshapes (the rest go to the Engine unchanged)
_HELPERS = {
    "generate": _do_generate,
    "begin_weight_update": _do_begin_weight_update,
    "end_weight_update": _do_end_weight_update,
    "update_weights_from_payloads": _do_update_weights_from_payloads,  # args: per-rank payloads, load_format, flush
    "flush_cache": _do_flush_cache,
    "reseed": _do_reseed,
    "rank_parameter_checksums": _do_rank_parameter_checksums,
}


def _watch_parent(parent_pid: int) -> None:
    """Kill this engine's whole process group if the process that owns the handle disappears."""
    while True:
        if os.getppid() != parent_pid:
            os.killpg(0, signal.SIGKILL)
        time.sleep(1.0)


def _fork_engine_children(conn: Connection) -> None:
    """CPU engines: start SGLang's scheduler and detokenizer processes by fork instead of spawn.

    Spawned, each of them imports torch and SGLang again (with the stubs and patches of the
    sitecustomize): about 20 s of CPU per engine on a 2-core machine, most of an engine's startup.
    Forked, they inherit this process's modules, imported once here. Safe without CUDA: nothing
    here has started a device context or an OpenMP pool. The children get /dev/null in place of
    this process's end of the owner's pipe, so the owner still sees EOF when this process dies.
    """
    import multiprocessing

    import sglang.srt.managers.detokenizer_manager  # noqa: F401 - imported once, inherited by the forks
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.models.registry  # noqa: F401 - and the model classes it imports

    set_start_method = multiprocessing.set_start_method

    def fork_always(method=None, force=False):  # SGLang's Engine asks for "spawn" (force=True)
        set_start_method("fork", force=True)

    multiprocessing.set_start_method = fork_always
    fd = conn.fileno()

    def release_owner_pipe() -> None:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, fd)  # the number stays valid, so nothing closes an unrelated file later
        os.close(devnull)

    os.register_at_fork(after_in_child=release_owner_pipe)


def _child_main() -> None:
    """Entry point of the engine process: build the Engine, then serve requests from the pipe."""
    conn = Connection(int(sys.argv[1]))
    threading.Thread(target=_watch_parent, args=(int(sys.argv[2]),), daemon=True).start()
    try:
        kwargs = conn.recv()
        import sglang

        if kwargs.get("device") == "cpu":
            _fork_engine_children(conn)
        engine = sglang.Engine(**kwargs)
        from parallel.cpu.sglang_stubs import STUBBED, is_stub

        stubs = [m for m in STUBBED if is_stub(sys.modules.get(m))]
        conn.send(("ok", {"pid": os.getpid(), "engine_kwargs": kwargs, "cpu_stubs": stubs}))
    except BaseException:
        try:
            conn.send(("fatal", traceback.format_exc()))
        finally:
            sys.stdout.flush()
            os._exit(1)
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        if method == "__shutdown__":
            break
        try:
            fn = _HELPERS.get(method)
            result = fn(engine, *args, **kwargs) if fn else getattr(engine, method)(*args, **kwargs)
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    try:
        engine.shutdown()
    finally:
        sys.stdout.flush()
        os._exit(0)
