"""A process-isolated handle to a real ``sglang.Engine``: :class:`SGLangEngine`, the owner's side.

Why a separate process: SGLang's Engine runs its scheduler(s) and detokenizer as child processes,
and when one of them dies SGLang's ``kill_process_tree`` kills the *parent* too. Hosting the Engine
in a dedicated child (its own session and process group) turns such a crash into an
:class:`EngineDiedError` in the caller; shutdown, timeout and crash all kill the whole group, so
no engine process outlives the handle.

The handle is shaped like ``sglang.Engine`` (token ids in, token ids out) so it can grow: every
request is a ``(method, args, kwargs)`` message over a pipe, see :meth:`SGLangEngine.call`; what
answers it in the engine process is :mod:`megarl.rollout.sglang.engine_process`.
Without CUDA it selects SGLang's CPU path (torch-native attention, pytorch sampling) and installs
the import stubs of :mod:`megarl.rollout.sglang.cpu.stubs` in the engine's processes.

Every process of the engine starts with :data:`SITE_DIR` first on ``PYTHONPATH``: its
``sitecustomize`` installs the stubs (``MEGARL_CPU_STUBS=1``, CPU engines, see :func:`child_env`)
and megarl's patches of SGLang (``MEGARL_SGLANG_SCHEDULER_PATCH=1``, every device, see
:mod:`megarl.rollout.sglang.patches`) at interpreter start, before SGLang is imported.

Weight sync: :meth:`SGLangEngine.update_weights_direct` copies already-sharded tensors into each TP
rank's own parameters (one payload per rank, SGLang's ``load_format="direct"``, encoded by
:mod:`megarl.rollout.sglang.transport`) inside a :meth:`SGLangEngine.weight_update` session;
:meth:`SGLangEngine.rank_parameter_checksums` reads back what every rank holds, hashed inside the
scheduler processes.

Colocated memory: :meth:`SGLangEngine.release_memory` gives back every GPU memory type SGLang tags
and :meth:`SGLangEngine.resume_memory` takes back the weights' (before a full sync) or the rest
(after it), with SGLang's own tag constants (in the engine process).

Reproducible sampling: :meth:`SGLangEngine.reseed` puts every scheduler (TP rank) into the
sampling state of a freshly started engine whose ``random_seed`` is the given seed (through the
``megarl_reseed`` method :mod:`megarl.rollout.sglang.patches` adds to SGLang's scheduler).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from megarl.rollout.sglang.transport import FlatBucket, SharedMemoryStaging, serialize_rank_tensors

_PROJECT_ROOT = Path(__file__).resolve().parents[3]
# The interpreter-start hooks of every engine process: a directory (not a package) holding a
# ``sitecustomize.py``, put first on the engine's PYTHONPATH.
SITE_DIR = Path(__file__).resolve().parent / "engine_site"

# SGLang settings for its CPU path (see docs/cpu.md); the caller's kwargs win.
CPU_ENGINE_DEFAULTS: dict[str, Any] = dict(
    device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
    disable_cuda_graph=True, mem_fraction_static=0.05, max_total_tokens=4096,
)


# Set in the engine's environment: its processes add ``Scheduler.megarl_reseed`` at import time.
SCHEDULER_PATCH_ENV_VAR = "MEGARL_SGLANG_SCHEDULER_PATCH"
# SGLang's model registry imports only this package's model classes (megarl's families) instead of
# every architecture it has; others still resolve (see megarl.rollout.sglang.models).
EXTERNAL_MODEL_PACKAGE_ENV_VAR = "SGLANG_EXTERNAL_MODEL_PACKAGE"
SGLANG_MODELS_PACKAGE = "megarl.rollout.sglang.models"


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


def child_env(env: dict[str, str] | None = None, override: tuple[str, ...] = ()) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) with which every Python process installs the
    CPU import stubs of :mod:`megarl.rollout.sglang.cpu.stubs` at start: ``MEGARL_CPU_STUBS=1`` (plus
    ``MEGARL_CPU_STUBS_OVERRIDE`` for ``override``) and :data:`SITE_DIR` plus the project root
    first on ``PYTHONPATH``."""
    from megarl.rollout.sglang.cpu.stubs import ENV_VAR, OVERRIDE_ENV_VAR

    env = dict(os.environ if env is None else env)
    paths = [str(SITE_DIR), str(_PROJECT_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(
        paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths])
    env[ENV_VAR] = "1"
    if override:
        env[OVERRIDE_ENV_VAR] = ",".join(override)
    return env


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
        self.model_path = str(model_path)
        # sleep_on_idle: an idle scheduler otherwise busy-polls its sockets (measured: 0.64 CPU
        # cores per idle CPU engine, 0.007 with it), stealing the CPU that colocated training uses.
        kwargs: dict[str, Any] = dict(model_path=str(model_path), tp_size=tp_size, dtype=dtype,
                                      skip_tokenizer_init=True, sleep_on_idle=True)
        engine_env = dict(os.environ)
        if device == "cpu":
            kwargs.update(CPU_ENGINE_DEFAULTS)
            engine_env = child_env(engine_env)
            engine_env["SGLANG_USE_CPU_ENGINE"] = "1"
            # SGLang's @torch.compile'd helpers (e.g. the vocab embedding's mask at TP > 1) would be
            # compiled to C++ by inductor on each scheduler's first request: a tiny TP=2 engine's
            # first generate took 38-55 s, each later one under 1 s. Eager, they are a few ops.
            engine_env.setdefault("TORCHDYNAMO_DISABLE", "1")
            if tp_size > 1:  # one NUMA node cannot host several ranks without an explicit bind
                engine_env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_threads_bind(tp_size))
        # The sitecustomize in SITE_DIR installs the scheduler patch (reseed) on every device and
        # the CPU stubs only where MEGARL_CPU_STUBS=1 (set above for CPU engines).
        front = [str(SITE_DIR), str(_PROJECT_ROOT)]
        engine_env["PYTHONPATH"] = os.pathsep.join(
            front + [p for p in engine_env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in front])
        engine_env[SCHEDULER_PATCH_ENV_VAR] = "1"
        engine_env.setdefault(EXTERNAL_MODEL_PACKAGE_ENV_VAR, SGLANG_MODELS_PACKAGE)
        engine_env.update(env or {})
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
                [sys.executable, "-c", "from megarl.rollout.sglang.engine_process import _child_main; _child_main()",
                 str(child_sock.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=engine_env,
                pass_fds=(child_sock.fileno(),), start_new_session=True, cwd=str(_PROJECT_ROOT))
        child_sock.close()
        self.pid = self._proc.pid  # also the process-group id of every engine process
        self._conn = Connection(parent_sock.detach())
        self._finalizer = weakref.finalize(self, _kill_group, self.pid)
        self._closed = False
        self._weight_update_open = False  # between begin_weight_update and end_weight_update
        self._parameter_names: list[frozenset[str]] | None = None
        self._released: set[str] = set()  # what release_memory gave back and resume_memory did not take yet
        self._staging = SharedMemoryStaging()
        self._conn.send(kwargs)
        self.info = self._wait_reply(startup_timeout_s, "startup")

    # ------------------------------------------------------------------ requests

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run ``engine.<method>(*args, **kwargs)`` in the engine process and return its (picklable)
        result; methods with a helper in ``megarl.rollout.sglang.engine_process._HELPERS`` run that
        instead."""
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
                 return_logprob: bool = False, timeout_s: float | None = None,
                 return_routed_experts: bool = False) -> list[dict]:
        """One dict per prompt: ``output_ids``, ``finish_reason`` ("stop": an end or stop token,
        "length": ``max_new_tokens`` reached, "abort"), ``cached_tokens`` (prompt tokens
        whose KV came from the prefix cache), with ``return_logprob`` ``output_logprobs``
        (log-prob of each output token) and, with ``return_routed_experts`` (an MoE model on an
        engine started with ``enable_return_routed_experts=True``), ``routed_experts``: the
        experts SGLang routed each position of prompt + output (but the last) to, an int32 tensor
        [positions, layers, top-k] of global expert ids."""
        self._refuse_while_released("generate")
        results = self.call("generate", input_ids, sampling_params, return_logprob, return_routed_experts,
                            timeout_s=timeout_s)
        if return_routed_experts:
            import torch

            for result in results:
                routes = torch.from_numpy(result["routed_experts"])
                result["routed_experts"] = routes.reshape(routes.shape[0], -1, self._experts_per_token)
        return results

    @functools.cached_property
    def _experts_per_token(self) -> int:
        """The served MoE model's top-k (read once from its config.json)."""
        import json

        return json.loads((Path(self.model_path) / "config.json").read_text())["num_experts_per_tok"]

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
        self._refuse_while_released("reseed")
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
        per rank, each rank decodes only its own (:mod:`megarl.rollout.sglang.transport`). Must run inside
        :meth:`weight_update`. ``flush_cache`` flushes SGLang's prefix cache after the load (pass
        False for all but the last bucket).
        CPU tensors travel as one flat bucket per rank in this handle's shared-memory staging
        buffers (:class:`megarl.rollout.sglang.transport.SharedMemoryStaging`) unless
        ``via_shared_memory=False`` or /dev/shm is too small; then their bytes go inline.

        SGLang's direct loader checks nothing before copying, and a bad entry kills the engine
        (the scheduler dies: :class:`EngineDiedError`). Names are checked here first against
        :meth:`rank_parameter_names` (ValueError, engine unharmed); shapes and dtypes are the
        caller's plan's to get right (a mismatch is an assertion in the scheduler).
        """
        self._check_open(len(per_rank))
        self._check_names([list(tensors) for tensors in per_rank])
        payloads = [(self._staging.payload(rank, tensors) if via_shared_memory else None)
                    or serialize_rank_tensors(tensors) for rank, tensors in enumerate(per_rank)]
        self.call("update_weights_from_payloads", payloads, "direct", flush_cache, timeout_s=timeout_s)

    def update_weights_flat(self, per_rank: list[FlatBucket | None], flush_cache: bool = True,
                            timeout_s: float | None = None) -> None:
        """As :meth:`update_weights_direct`, for one flat bucket per TP rank (None: nothing for that
        rank) as a trainer made it (:mod:`megarl.rollout.sglang.transport`): a bucket that names its
        buffer (shared memory, CUDA IPC) goes to the rank's scheduler as it is, one whose bytes came
        inline is staged in this handle's shared memory first."""
        self._check_open(len(per_rank))
        self._check_names([bucket.layout.names if bucket else [] for bucket in per_rank])
        payloads = []
        for rank, bucket in enumerate(per_rank):
            if bucket is None or bucket.payload is not None:
                payloads.append(bucket.payload if bucket else serialize_rank_tensors({}))
                continue
            tensors = bucket.inline_tensors()
            payloads.append(self._staging.payload(rank, tensors) or serialize_rank_tensors(tensors))
        self.call("update_weights_from_payloads", payloads, "direct", flush_cache, timeout_s=timeout_s)

    def _check_open(self, ranks: int) -> None:
        if not self._weight_update_open:
            raise RuntimeError("weight updates must run inside engine.weight_update() "
                               "(SGLang refuses weight updates outside a begin/end session)")
        if "weights" in self._released:
            raise RuntimeError("weight update: the engine's weights are released (release_memory); "
                               "resume_memory(weights=True) first")
        if ranks != self.tp_size:
            raise ValueError(f"a weight update got {ranks} per-rank entries for an engine "
                             f"with tp_size={self.tp_size}: pass exactly one dict per TP rank")

    def _check_names(self, per_rank: list[list[str]]) -> None:
        """ValueError (engine unharmed) for a name a rank's model lacks: SGLang's direct loader
        checks nothing, and a bad entry kills its scheduler."""
        for rank, (names, known) in enumerate(zip(per_rank, self.rank_parameter_names())):
            unknown = sorted(set(names) - known)
            if unknown:
                raise ValueError(f"weight update: TP rank {rank} has no parameter(s) {unknown[:5]}"
                                 f"{' ...' if len(unknown) > 5 else ''}; its parameters are SGLang's "
                                 f"names, e.g. {sorted(known)[:3]}")

    def get_weights_by_name(self, name: str, truncate_size: int = 100,
                            timeout_s: float | None = None) -> list | None:
        """SGLang's ``get_weights_by_name``: TP rank 0's first ``truncate_size`` rows of a parameter
        as nested lists (HF names accepted for fused parameters; at TP>1 SGLang all-gathers
        ``o_proj``/``down_proj`` columns). A debugging probe, not a per-rank view."""
        return self.call("get_weights_by_name", name, truncate_size, timeout_s=timeout_s)

    def flush_cache(self, timeout_s: float | None = None) -> bool:
        """Flush SGLang's prefix (radix) cache; False when SGLang refused (requests in flight)."""
        return self.call("flush_cache", timeout_s=timeout_s)

    # ------------------------------------------------------------------ memory (colocated engines)

    @property
    def memory_released(self) -> bool:
        """Whether :meth:`release_memory` gave memory back that is not resumed yet."""
        return bool(self._released)

    def release_memory(self, timeout_s: float | None = None) -> None:
        """Give back every GPU memory type SGLang tags (its ``GPU_MEMORY_ALL_TYPES``: weights, KV
        cache, CUDA graphs; the prefix cache is flushed), while no request runs. Freed only on an
        engine started with ``enable_memory_saver=True`` (GPU), where the weights are discarded
        (SGLang keeps no copy without ``enable_weights_cpu_backup``): after ``resume_memory(weights=True)``
        they hold garbage until a full weight sync. Without the saver (CPU) SGLang runs the same
        steps and frees nothing. Until both parts are resumed, :meth:`generate` is refused."""
        if self._released:
            raise RuntimeError("release_memory: the engine's memory is released already")
        self.rank_parameter_names()  # read (once) while the weights are there: a sync checks names against them
        self.call("release_memory", timeout_s=timeout_s)
        self._released = {"weights", "the KV cache and CUDA graphs"}

    def resume_memory(self, weights: bool, timeout_s: float | None = None) -> None:
        """Take back the weights' memory (``weights=True``; then write every parameter: see
        :meth:`release_memory`) or the KV cache's and CUDA graphs' (``weights=False``), released by
        :meth:`release_memory` (SGLang kills the scheduler that resumes a type it did not release)."""
        part = "weights" if weights else "the KV cache and CUDA graphs"
        if part not in self._released:
            raise RuntimeError(f"resume_memory: {part} of the engine are not released")
        self.call("resume_memory", weights, timeout_s=timeout_s)
        self._released.discard(part)

    def _refuse_while_released(self, what: str) -> None:
        """Generation needs the weights and the KV cache (and on GPU the CUDA graphs) in place."""
        if self._released:
            raise RuntimeError(f"{what}: the engine's {' and '.join(sorted(self._released))} are released "
                               "(release_memory); resume them first (the weights for a full weight sync)")

    def rank_parameter_names(self) -> list[frozenset[str]]:
        """Per TP rank, the names :meth:`update_weights_direct` accepts (SGLang's parameter names).
        Read once per engine, from :meth:`rank_parameter_checksums`."""
        if self._parameter_names is None:
            self._parameter_names = [frozenset(c) for c in self.rank_parameter_checksums()]
        return self._parameter_names

    def rank_parameter_checksums(self, timeout_s: float | None = None) -> list[dict[str, str]]:
        """Per TP rank (index = rank), ``{name: checksum}`` of every parameter (and persistent
        buffer), computed inside each scheduler process by SGLang's own weight checker
        (``check_weights(action="checksum")``) with :func:`megarl.rollout.weight_sync.weight_checksum`
        as its hash.
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
