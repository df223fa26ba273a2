"""A probe that runs inside each SGLang scheduler (TP rank) of a test engine (test code only).

SGLang runs a function named in ``ServerArgs.custom_weight_loader`` on every TP rank when
``update_weights_from_tensor`` is called with that function's import path as ``load_format``;
the function gets the rank's model and the rank's own payload. The probe uses that hook to
observe what no public API returns: where each parameter's memory is (``data_ptr``), so a test
can tell an in-place update from a reallocation. The payload carries one entry whose NAME is the
output file prefix; rank r writes ``<prefix>.rank<r>.json``.
"""

from __future__ import annotations

import json

PROBE = "tests.megarl.rollout.sglang_probe.record_parameter_pointers"  # load_format / custom_weight_loader entry


def record_parameter_pointers(model, named_tensors) -> None:
    from sglang.srt.runtime_context import get_parallel

    (prefix, _), = named_tensors
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    with open(f"{prefix}.rank{get_parallel().tp_rank}.json", "w") as f:
        json.dump(pointers, f)


def parameter_pointers(engine, prefix: str) -> list[dict[str, int]]:
    """``{name: data_ptr}`` per TP rank of an engine started with
    ``custom_weight_loader=[PROBE]`` (runs one no-op weight-update session)."""
    import torch

    from megarl.rollout.sglang.transport import serialize_rank_tensors

    payloads = [serialize_rank_tensors({prefix: torch.zeros(1)}) for _ in range(engine.tp_size)]
    with engine.weight_update():
        engine.call("update_weights_from_payloads", payloads, PROBE, False)
    result = []
    for rank in range(engine.tp_size):
        with open(f"{prefix}.rank{rank}.json") as f:
            result.append(json.load(f))
    return result
