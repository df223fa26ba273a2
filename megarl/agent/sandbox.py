"""Run model-written Python in a fresh, limited interpreter: ``run_python(code, limits)``.

Each call starts ``python -I`` (this interpreter's executable, so the same installed packages)
in a new session, in a temporary working directory that is removed afterwards, also on timeout.
A short prelude, run before the code, applies the limits:

* CPU time (``RLIMIT_CPU``), address space (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``, so the
  code cannot fill the disk) and no core files. They are set by the child itself rather than in a
  ``preexec_fn``, because ``preexec_fn`` can deadlock when the parent has threads, and
  ``ToolRegistry.call_all`` runs calls from a thread pool. ``RLIMIT_NPROC`` is not set: it counts
  every process of the user, so no value is right for all hosts; process creation is refused
  by the audit hook below instead.
* an audit hook (``sys.addaudithook``, which Python code cannot remove) that refuses socket
  creation and use and the creation of processes (``subprocess``, ``os.system``, ``os.fork``,
  ``os.exec*``, ``os.posix_spawn``), so the code has no network and cannot start ``curl``;
* a minimal environment (``PATH``, a UTF-8 locale, ``HOME``/``TMPDIR`` in the working directory,
  one BLAS thread).

This stops honest mistakes and Python-level access, not a determined attacker: ``ctypes`` can
call libc directly, and as root the child may raise its own hard limits again. The production
answer for untrusted code is a container or VM (no network namespace, seccomp, cgroups); this
module is the part that does not need privileges.

The wall-time limit is enforced from outside: past ``timeout_s`` the whole process group gets
SIGKILL. Output goes to files (never pipes), of which only the first bytes are read, so a huge
print cannot fill this process's memory.

``ToolLimits`` and ``ToolResult`` live here, in the lower of the two modules, and are
re-exported by ``megarl.agent.tools``.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ERROR_KINDS = ("unknown_tool", "bad_arguments", "raised", "timeout", "memory", "crashed", "output_too_long", "non_text")

_MEMORY_EXIT = 86  # the prelude's exit status on an uncaught MemoryError (code exiting with 86 itself reads the same)
_FSIZE_BYTES = 64 * 1024 * 1024  # largest file the code may write (stdout included)
_STDERR_LINES = 20  # how much of a traceback a crash shows

# Runs in the child as ``python -I -c _PRELUDE AS_BYTES CPU_S FSIZE_BYTES``, in the working
# directory that holds main.py. Everything is local to _main so the code's globals stay clean.
_PRELUDE = f"""
def _main():
    import os, resource, sys, traceback
    as_bytes, cpu_s, fsize = (int(v) for v in sys.argv[1:4])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    spawn = ("subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn")

    def refuse(event, args):
        if event.startswith("socket.") or event in spawn:
            raise PermissionError(event + " is not allowed in this sandbox (no network, no new processes)")

    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    sys.argv = ["main.py"]
    namespace = sys.modules["__main__"].__dict__
    del namespace["_main"]
    namespace["__file__"] = "main.py"
    sys.addaudithook(refuse)
    resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
    try:
        exec(code, namespace)
    except MemoryError:
        os.write(2, b"MemoryError\\n")
        os._exit({_MEMORY_EXIT})
    except SystemExit:
        raise
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.exit(1)


_main()
"""


@dataclass(frozen=True)
class ToolLimits:
    """Limits on one tool call: wall time, and for the ``python`` sandbox CPU time and address
    space; ``max_output_chars`` caps the text the model is shown, for every tool."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    cpu_s: float = 10.0
    max_output_chars: int = 4000

    def __post_init__(self):
        for field in ("timeout_s", "memory_mb", "cpu_s", "max_output_chars"):
            if not getattr(self, field) > 0:
                raise ValueError(f"ToolLimits.{field} must be > 0, got {getattr(self, field)!r}")


@dataclass(frozen=True)
class ToolResult:
    """What one tool call gives back: the text the model is shown (always a str within the output
    limit) and ``error``: None if the tool ran fine, else one of ``ERROR_KINDS``."""

    text: str
    error: str | None = None


def too_long(text: str, size: str, max_chars: int) -> ToolResult:
    """An ``output_too_long`` result showing the start of ``text`` (whose full size is ``size``,
    e.g. ``"12000 characters"``) with a note, all within ``max_chars``."""
    note = f"Error: the output was too long ({size}); only its start is shown.\n"
    return ToolResult((note + text)[:max_chars], "output_too_long")


def _read_head(path: str, max_bytes: int) -> tuple[str, int]:
    """The first ``max_bytes`` of a file as text, and the file's size in bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return f.read(max_bytes).decode("utf-8", errors="replace"), size


def _read_tail(path: str, max_chars: int) -> str:
    """Whole lines from the end of a file (at most ``_STDERR_LINES``), within ``max_chars``."""
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * max_chars))
        lines = f.read().decode("utf-8", errors="replace").rstrip("\n").splitlines()[-_STDERR_LINES:]
    while len(lines) > 1 and sum(len(line) + 1 for line in lines) > max_chars:
        lines.pop(0)
    return "\n".join(lines)[-max_chars:]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # e.g. a real-time signal
        return str(number)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # the group is already gone
        pass
    proc.wait()


def run_python(code: str, limits: ToolLimits) -> ToolResult:
    """Run ``code`` in a fresh sandboxed interpreter; its stdout, or an error result.

    Error kinds: ``timeout`` (wall time or CPU time), ``memory`` (MemoryError under the address
    space limit), ``crashed`` (non-zero exit or a signal; the text holds the traceback's last
    lines), ``output_too_long`` (stdout past ``max_output_chars``; its start is still shown).
    Error texts start with ``"Error:"``; whatever the code printed follows them.
    """
    max_chars = limits.max_output_chars
    root = tempfile.mkdtemp(prefix="megarl-python-tool-")
    try:
        workdir = os.path.join(root, "work")
        os.mkdir(workdir)
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        limits_argv = [str(limits.memory_mb * 1024 * 1024), str(max(1, math.ceil(limits.cpu_s))), str(_FSIZE_BYTES)]
        stdout_path, stderr_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            # -u: what the code printed before a timeout is in the file when it is killed.
            proc = subprocess.Popen(
                [sys.executable, "-I", "-u", "-c", _PRELUDE, *limits_argv],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        timed_out = False
        try:
            proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)  # also anything it left behind in its group
        stdout, stdout_bytes = _read_head(stdout_path, 4 * max_chars + 4)
        status = proc.returncode
        if timed_out:
            error, head = "timeout", f"Error: the code timed out after {limits.timeout_s} s."
        elif status in (-signal.SIGXCPU, -signal.SIGKILL):
            error, head = "timeout", f"Error: the code used more than {limits.cpu_s} s of CPU time and was stopped."
        elif status == _MEMORY_EXIT:
            error, head = "memory", f"Error: the code ran out of memory (limit {limits.memory_mb} MB)."
        elif status != 0:
            if status < 0:
                head = f"Error: the code was killed by signal {_signal_name(-status)}."
            else:
                head = f"Error: the code exited with status {status}."
            tail = _read_tail(stderr_path, max_chars // 2)
            error, head = "crashed", head + (f"\n{tail}" if tail else "")
        elif len(stdout) > max_chars:  # also when the file is longer than what was read
            return too_long(stdout, f"{stdout_bytes} bytes", max_chars)
        else:
            return ToolResult(stdout)
        if stdout:
            head += "\nOutput before the error:\n" + stdout
        return ToolResult(head[:max_chars], error)
    finally:
        shutil.rmtree(root, ignore_errors=True)
