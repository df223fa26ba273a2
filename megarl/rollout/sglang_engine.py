"""A process-isolated handle to a real ``sglang.Engine``.

Why a separate process: SGLang's Engine runs its scheduler(s) and detokenizer as child processes,
and when one of them dies SGLang's ``kill_process_tree`` kills the *parent* too. Hosting the Engine
in a dedicated child (its own session and process group) turns such a crash into an
:class:`EngineDiedError` in the caller; shutdown, timeout and crash all kill the whole group, so
no engine process outlives the handle.

The handle is shaped like ``sglang.Engine`` (token ids in, token ids out) so it can grow: every
request is a ``(method, args, kwargs)`` message over a pipe, see :meth:`SGLangEngine.call`.
Without CUDA it selects SGLang's CPU path (torch-native attention, pytorch sampling) and installs
the import stubs of :mod:`parallel.cpu_stubs` in the engine's processes.
"""

from __future__ import annotations

import os
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
        kwargs: dict[str, Any] = dict(model_path=str(model_path), tp_size=tp_size, dtype=dtype,
                                      skip_tokenizer_init=True)
        child_env = dict(os.environ)
        if device == "cpu":
            from parallel.cpu_stubs import child_env as stub_env

            kwargs.update(CPU_ENGINE_DEFAULTS)
            child_env = stub_env(child_env)
            child_env["SGLANG_USE_CPU_ENGINE"] = "1"
            if tp_size > 1:  # one NUMA node cannot host several ranks without an explicit bind
                child_env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_threads_bind(tp_size))
        child_env["PYTHONPATH"] = os.pathsep.join(
            [str(_PROJECT_ROOT)] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
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
        """One dict per prompt: ``output_ids``, ``finish_reason`` and, with ``return_logprob``,
        ``output_logprobs`` (log-prob of each output token)."""
        return self.call("generate", input_ids, sampling_params, return_logprob, timeout_s=timeout_s)

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
        if self._own_log:
            Path(self.log_path).unlink(missing_ok=True)

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# ---------------------------------------------------------------------- engine process side


def _do_generate(engine, input_ids, sampling_params, return_logprob):
    outs = engine.generate(input_ids=input_ids, sampling_params=sampling_params,
                           return_logprob=return_logprob)
    results = []
    for out in [outs] if isinstance(outs, dict) else outs:
        meta = out["meta_info"]
        res = {"output_ids": list(out["output_ids"]), "finish_reason": meta.get("finish_reason")}
        if return_logprob:
            res["output_logprobs"] = [float(lp) for lp, *_ in meta["output_token_logprobs"]]
        results.append(res)
    return results


_HELPERS = {"generate": _do_generate}  # methods whose arguments/results the handle reshapes


def _watch_parent(parent_pid: int) -> None:
    """Kill this engine's whole process group if the process that owns the handle disappears."""
    while True:
        if os.getppid() != parent_pid:
            os.killpg(0, signal.SIGKILL)
        time.sleep(1.0)


def _child_main() -> None:
    """Entry point of the engine process: build the Engine, then serve requests from the pipe."""
    conn = Connection(int(sys.argv[1]))
    threading.Thread(target=_watch_parent, args=(int(sys.argv[2]),), daemon=True).start()
    try:
        kwargs = conn.recv()
        import sglang

        engine = sglang.Engine(**kwargs)
        from parallel.cpu_stubs import STUBBED, is_stub

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
