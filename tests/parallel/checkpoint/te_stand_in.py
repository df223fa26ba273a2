"""A CPU stand-in for a Transformer Engine (TE) layer-spec GPTModel, for name- and tensor-level tests.

TE cannot be installed here, so no model of megatron's ``get_gpt_layer_with_transformer_engine_spec``
can be built. What megarl's conversion, dist checkpoints and resharding see of such a model is
its parameters (names, shapes, TP attributes) and its ``sharded_state_dict``; the stand-in has
exactly those. It is megarl's local-spec GPTModel (``parallel.models.build_model_chunks``)
rearranged as the TE spec arranges the same weights:

- ``input_layernorm`` and ``pre_mlp_layernorm`` become ``IdentityOp`` (as in the TE spec) and their
  weights are registered on ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``, first, as
  TE's ``LayerNormLinear`` registers them. megatron's local ``ColumnParallelLinear.sharded_state_dict``
  is the same call as ``TELayerNormColumnParallelLinear.sharded_state_dict`` in megatron-core 0.16
  (``make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0, "bias": 0}, ...)``),
  so the fused norm is checkpointed as TE's is: key ``...linear_qkv.layer_norm_weight``, replicated
  over TP.
- The four linear layers' ``get_extra_state`` returns TE 2.x's value without FP8, an empty uint8
  tensor, so their ``_extra_state`` objects are TE's. The core attention gets none in the dist
  checkpoint: megatron-core 0.16's ``TEDotProductAttention.sharded_state_dict`` is empty unless
  the softmax is learnable.

The stand-in does not compute what a TE model computes (its norms are gone from the forward
pass); tests use it only to load, export, save and compare weights.
"""

from __future__ import annotations

import torch

LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def te_extra_state() -> torch.Tensor:
    """TE 2.x's ``TransformerEngineBaseModule.get_extra_state`` without FP8, as written there
    (written out here again, not imported from megarl: this is the test's own reading of TE)."""
    return torch.empty(0, dtype=torch.uint8)


def to_te_structure(chunks: list) -> list:
    """Rearrange megarl's local-spec chunks in place into TE-spec structure (see the module
    docstring); returns them."""
    from megatron.core.transformer.identity_op import IdentityOp

    from parallel.models import unwrap_model

    for chunk in chunks:
        for layer in unwrap_model(chunk).decoder.layers:
            for norm_name, linear in (("input_layernorm", layer.self_attention.linear_qkv),
                                      ("pre_mlp_layernorm", layer.mlp.linear_fc1)):
                weight = getattr(layer, norm_name).weight
                setattr(layer, norm_name, IdentityOp())
                others = dict(linear._parameters)
                linear._parameters.clear()
                linear.register_parameter("layer_norm_weight", weight)
                linear._parameters.update(others)
            for path in LINEARS:
                module = layer.get_submodule(path)
                module.get_extra_state = te_extra_state
    return chunks


def build_te_chunks(hf_config, layout) -> list:
    """This rank's TE-structured stand-in chunks (after ``initialize_megatron``)."""
    from parallel.models import build_model_chunks

    return to_te_structure(build_model_chunks(hf_config, layout))


def named_parameters(chunks: list) -> list[dict[str, torch.Tensor]]:
    from parallel.models import unwrap_model

    return [{name: p.detach().clone() for name, p in unwrap_model(chunk).named_parameters()} for chunk in chunks]


def compare(ours: list[dict], theirs: list[dict], what: str) -> tuple[int, list[str]]:
    """(parameters compared, mismatches: differing name sets or tensors not bit-equal)."""
    mismatches, count = [], 0
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if set(a) != set(b):
            mismatches.append(f"{what} chunk {index}: names differ: {sorted(set(a) ^ set(b))}")
        for name in sorted(set(a) & set(b)):
            count += 1
            if not torch.equal(a[name], b[name]):
                mismatches.append(f"{what} chunk {index} {name}")
    return count, mismatches


def dist_checkpoint_checks(hf_dir: str, te_ckpt: str, model_save_dir: str, layout_kwargs: dict) -> dict:
    """Rank function. With the TE checkpoint ``te_ckpt`` written by megarl's conversion
    (``--layer-spec te``), at ``layout_kwargs``:

    1. TE stand-in chunks loaded from it by megatron's own dist-checkpoint load equal, bit for bit
       and name for name, TE stand-in chunks that mbridge loaded from the HF checkpoint;
    2. megarl's local-spec chunks loaded from it equal local-spec chunks loaded from the HF
       checkpoint by ``load_hf_into_chunks`` (the norms are the same tensors under both names);
    3. the mbridge-loaded TE stand-in is saved by megatron's ``dist_checkpointing.save``
       (``save_megatron_checkpoint``) to ``model_save_dir``, for the caller to compare with ``te_ckpt``
       file content by file content;
    4. the streaming converter's view of a TE-structured (meta) model, its stored shards as boxes of
       HF tensors (``sharded_state_dict_with_boxes``), equals its view of the local-spec model.

    Returns this rank's {"params": n compared, "mismatches": [...]}.
    """
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import load_hf_into_chunks
    from parallel.checkpoint.dist_ckpt import load_megatron_checkpoint, save_megatron_checkpoint
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron
    from tests.parallel.checkpoint.mbridge_oracle import bridge_for, fill_with_nan

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    ckpt = HFCheckpoint(hf_dir)
    count, mismatches = 0, []

    from_ckpt = build_te_chunks(ckpt.config, layout)
    fill_with_nan(from_ckpt)
    metadata = load_megatron_checkpoint(from_ckpt, te_ckpt)
    from_mbridge = build_te_chunks(ckpt.config, layout)
    fill_with_nan(from_mbridge)
    with torch.no_grad():
        bridge_for(hf_dir, layout, layer_spec="te").load_weights(from_mbridge, hf_dir)
    n, bad = compare(named_parameters(from_ckpt), named_parameters(from_mbridge), "TE model from the checkpoint")
    count, mismatches = count + n, mismatches + bad

    local_from_ckpt = build_model_chunks(ckpt.config, layout)
    fill_with_nan(local_from_ckpt)
    load_megatron_checkpoint(local_from_ckpt, te_ckpt)
    local_from_hf = build_model_chunks(ckpt.config, layout)
    fill_with_nan(local_from_hf)
    load_hf_into_chunks(local_from_hf, ckpt, layout)
    n, bad = compare(named_parameters(local_from_ckpt), named_parameters(local_from_hf), "local model from the checkpoint")
    count, mismatches = count + n, mismatches + bad

    save_megatron_checkpoint(from_mbridge, model_save_dir, ckpt.config, layout)

    from parallel.checkpoint.stream import meta_chunks, sharded_state_dict_with_boxes

    _, te_boxes = sharded_state_dict_with_boxes(to_te_structure(meta_chunks(ckpt.config, layout)), ckpt.config, layout)
    _, local_boxes = sharded_state_dict_with_boxes(meta_chunks(ckpt.config, layout), ckpt.config, layout)
    if te_boxes != local_boxes:
        mismatches.append(f"shard boxes of the TE model differ: {sorted(set(te_boxes) ^ set(local_boxes))[:5]}")
    count += len(te_boxes)
    parallel_state.destroy_model_parallel()
    return {"params": count, "mismatches": mismatches, "layer_spec": metadata.get("layer_spec")}
