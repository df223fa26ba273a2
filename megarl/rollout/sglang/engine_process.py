"""What runs inside the engine process of a :class:`megarl.rollout.sglang.engine.SGLangEngine` handle.

The handle starts ``python -c "from megarl.rollout.sglang.engine_process import _child_main; _child_main()"``
in a new session and process group; :func:`_child_main` builds the ``sglang.Engine`` there and
serves the handle's ``(method, args, kwargs)`` requests from the pipe until shutdown. Methods
whose arguments or results the handle reshapes run an RPC handler here (``_do_*``, see
``_HELPERS``), the rest go to the Engine unchanged. :func:`_watch_parent` kills the whole group
when the owner of the handle disappears. CPU engines fork SGLang's scheduler and detokenizer
processes instead of spawning them (:func:`_fork_engine_children`).

Separate from the handle because it is the other end of the pipe: it runs in a different process,
imports SGLang, and is what SGLang's crashes take down.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from megarl.rollout.sglang.engine import SCHEDULER_PATCH_ENV_VAR
from megarl.rollout.sglang.patches import RESEED_BUSY, RESEED_RPC


def _do_generate(engine, input_ids, sampling_params, return_logprob, return_routed_experts=False):
    outs = engine.generate(input_ids=input_ids, sampling_params=sampling_params,
                           return_logprob=return_logprob, return_routed_experts=return_routed_experts)
    results = []
    for i, out in enumerate([outs] if isinstance(outs, dict) else outs):
        meta = out["meta_info"]
        reason = meta.get("finish_reason")  # SGLang: {"type": "stop" | "length" | "abort", ...}
        res = {"output_ids": list(out["output_ids"]),
               "finish_reason": reason.get("type") if isinstance(reason, dict) else reason,
               "cached_tokens": int(meta.get("cached_tokens", 0))}
        if return_logprob:
            res["output_logprobs"] = [float(lp) for lp, *_ in meta["output_token_logprobs"]]
        if return_routed_experts:  # base64 of int32 [prompt + output - 1 positions, layers, top-k]
            import numpy as np  # an array pickles by value; a torch tensor would go as a shared fd
            import pybase64

            routes = np.frombuffer(pybase64.b64decode(meta["routed_experts"]), dtype=np.int32)
            res["routed_experts"] = routes.reshape(len(input_ids[i]) + len(res["output_ids"]) - 1, -1)
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
        if RESEED_BUSY in message and time.monotonic() < deadline:
            time.sleep(0.05)
            continue
        hint = ""
        if RESEED_RPC in message and "attribute" in message:
            hint = (f"\n(the schedulers lack {RESEED_RPC}: they must start with "
                    f"{SCHEDULER_PATCH_ENV_VAR}=1 and megarl/rollout/sglang/engine_site on PYTHONPATH, as "
                    f"SGLangEngine arranges; see megarl.rollout.sglang.patches.install_scheduler_patch)")
        raise RuntimeError(f"SGLang schedulers refused {RESEED_RPC}(seed={seed}): {message}{hint}")


def _do_flush_cache(engine):
    return bool(engine.flush_cache().success)


def _do_release_memory(engine):
    """SGLang's release of every GPU memory type it tags (weights, KV cache, CUDA graphs)."""
    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

    engine.release_memory_occupation(tags=list(GPU_MEMORY_ALL_TYPES))


def _do_resume_memory(engine, weights: bool):
    """SGLang's resume of the weights' memory (``weights``), or of every other type it tags."""
    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES, GPU_MEMORY_TYPE_WEIGHTS

    tags = [GPU_MEMORY_TYPE_WEIGHTS] if weights else [t for t in GPU_MEMORY_ALL_TYPES if t != GPU_MEMORY_TYPE_WEIGHTS]
    engine.resume_memory_occupation(tags=tags)


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
    "release_memory": _do_release_memory,
    "resume_memory": _do_resume_memory,  # args: weights (True) or the rest (False)
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
        from megarl.rollout.sglang.cpu.stubs import STUBBED, is_stub

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
