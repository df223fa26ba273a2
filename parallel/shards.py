"""Where every shard of every parameter lives, as boxes of the canonical (HF) tensors.

A layout's local tensor (one parameter on one rank) is described as a list of ``Piece``s: each
piece says "this box of the local tensor holds that box of HF tensor X" (or zeros, for vocab
padding). The HF checkpoint is the canonical coordinate system shared by every layout, so
any two layouts can be related by intersecting boxes (see ``parallel/reshard/plan.py``), and a layout's
description can be checked on its own: every element of every local tensor covered exactly once.

``megatron_shards`` derives the description of a Megatron TP/PP/VPP layout from a family's
weight rules and megatron's own layer numbering, without building the model (so it plans 70B
models on a laptop); ``sglang_shards`` that of SGLang's TP (and expert-parallel) ranks.

Geometry only, below its two users: checkpoint IO (``parallel.checkpoint``: which boxes a rank
reads and writes) and resharding (``parallel.reshard``: which boxes move where).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from model_specs import family_for, num_experts, padded_vocab_size
from parallel.layout import MegatronLayout
from parallel.models import megatron_config

Box = tuple[tuple[int, int], ...]  # per dimension [start, stop)


@dataclasses.dataclass(frozen=True)
class Piece:
    """``dst`` box of the local tensor holds ``src`` box of canonical tensor ``hf`` (None: zeros).
    ``dst`` may have more dimensions than ``src``: the extra, leading ones have extent 1 (one
    expert's slot in a tensor that stacks a layer's experts, as SGLang's fused experts do)."""

    dst: Box
    hf: str | None
    src: Box


@dataclasses.dataclass(frozen=True)
class LocalTensor:
    """One parameter as one rank holds it."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class MegatronRank:
    """A model-parallel position: ranks at the same position hold the same tensors. ``ep``/``etp``:
    the expert-parallel and expert-tensor-parallel ranks (0 for a dense model)."""

    pp: int
    tp: int
    ep: int = 0
    etp: int = 0


def megatron_position(rank: int, layout: MegatronLayout, world_size: int) -> MegatronRank:
    """Global rank -> model position, in megatron's rank orders: tp-cp-dp-pp for the dense
    weights, etp-ep-edp-pp for the experts (both fastest-first within a pipeline stage)."""
    stage_size = world_size // layout.pp
    in_stage = rank % stage_size
    return MegatronRank(pp=rank // stage_size, tp=in_stage % layout.tp, ep=(in_stage // layout.etp) % layout.ep,
                        etp=in_stage % layout.etp)


def megatron_positions(layout: MegatronLayout) -> list[MegatronRank]:
    """Every distinct model position of ``layout``, whatever its data parallelism: a position is a
    function of the rank within its stage modulo lcm(tp, ep*etp), which divides every valid stage size."""
    period = math.lcm(layout.tp, layout.ep * layout.etp)
    world = period * layout.pp
    return sorted({megatron_position(rank, layout, world) for rank in range(world)},
                  key=lambda p: (p.pp, p.tp, p.ep, p.etp))


def box_volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def full_box(shape) -> Box:
    return tuple((0, n) for n in shape)


def extents_match(src: Box, dst: Box) -> bool:
    """Whether ``dst`` has ``src``'s extents, after leading dimensions of extent 1 (see ``Piece``)."""
    lead = len(dst) - len(src)
    return lead >= 0 and [b - a for a, b in dst] == [1] * lead + [b - a for a, b in src]


def box_intersection(a: Box, b: Box) -> Box | None:
    """The common region of two boxes, None if they do not overlap."""
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _rows(box: Box, start: int, stop: int) -> Box:
    """``box`` with its dim-0 range replaced."""
    return ((start, stop), *box[1:])


def check_coverage(tensor: LocalTensor) -> None:
    """Raise unless the pieces cover every element of ``tensor`` exactly once, in bounds,
    with source and destination boxes of equal extent."""
    for piece in tensor.pieces:
        if len(piece.dst) != len(tensor.shape) or any(
            not 0 <= a < b <= n for (a, b), n in zip(piece.dst, tensor.shape)
        ):
            raise ValueError(f"{tensor.name}: piece {piece} is outside shape {tensor.shape}")
        if piece.hf is not None and not extents_match(piece.src, piece.dst):
            raise ValueError(f"{tensor.name}: piece {piece} has source and destination of different extents")
    covered = sum(box_volume(p.dst) for p in tensor.pieces)
    if covered != math.prod(tensor.shape):
        raise ValueError(f"{tensor.name}: pieces cover {covered} elements of {math.prod(tensor.shape)}")
    for i, a in enumerate(tensor.pieces):
        for b in tensor.pieces[i + 1:]:
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a.dst, b.dst)):
                raise ValueError(f"{tensor.name}: pieces {a} and {b} overlap")


def _split_rows(hf_name: str, hf_shape, rank: int, parts: int, dst_row: int) -> tuple[Piece, int]:
    """Rank ``rank``'s 1/parts of an HF tensor's rows, placed at local row ``dst_row``."""
    rows = hf_shape[0] // parts
    src = _rows(full_box(hf_shape), rank * rows, (rank + 1) * rows)
    return Piece(_rows(full_box(hf_shape), dst_row, dst_row + rows), hf_name, src), dst_row + rows


def rule_pieces(kind: str, hf_names, hf_shapes, tp_rank: int, tp: int, padded_rows: int | None,
                heads_per_group: int = 1, head_dim: int = 1) -> tuple[tuple[int, ...], list[Piece]]:
    """Local shape and pieces of one Megatron parameter on TP rank ``tp_rank`` (see WEIGHT_KINDS)."""
    shape0 = hf_shapes[0]
    if kind == "replicated":
        return tuple(shape0), [Piece(full_box(shape0), hf_names[0], full_box(shape0))]
    if kind == "column":
        piece, rows = _split_rows(hf_names[0], shape0, tp_rank, tp, 0)
        return (rows, *shape0[1:]), [piece]
    if kind == "row":
        cols = shape0[1] // tp
        box = ((0, shape0[0]), (tp_rank * cols, (tp_rank + 1) * cols), *full_box(shape0)[2:])
        return (shape0[0], cols, *shape0[2:]), [Piece(((0, shape0[0]), (0, cols), *box[2:]), hf_names[0], box)]
    if kind == "vocab":
        rows = padded_rows // tp
        start, stop = tp_rank * rows, (tp_rank + 1) * rows
        local = (rows, *shape0[1:])
        pieces = []
        real_stop = min(stop, shape0[0])
        if real_stop > start:
            pieces.append(Piece(_rows(full_box(local), 0, real_stop - start), hf_names[0],
                                _rows(full_box(shape0), start, real_stop)))
        if stop > max(start, shape0[0]):
            pad_start = max(start, shape0[0]) - start
            pieces.append(Piece(_rows(full_box(local), pad_start, rows), None, ()))
        return local, pieces
    if kind == "gate_up":
        gate, dst = _split_rows(hf_names[0], hf_shapes[0], tp_rank, tp, 0)
        up, dst = _split_rows(hf_names[1], hf_shapes[1], tp_rank, tp, dst)
        return (dst, *shape0[1:]), [gate, up]
    if kind == "qkv":
        q_shape, k_shape, v_shape = hf_shapes
        groups = k_shape[0] // head_dim
        local_groups = groups // tp
        q_rows, kv_rows = heads_per_group * head_dim, head_dim
        pieces, dst = [], 0
        for group in range(tp_rank * local_groups, (tp_rank + 1) * local_groups):
            for name, shape, rows in ((hf_names[0], q_shape, q_rows), (hf_names[1], k_shape, kv_rows),
                                      (hf_names[2], v_shape, kv_rows)):
                src = _rows(full_box(shape), group * rows, (group + 1) * rows)
                pieces.append(Piece(_rows(full_box(shape), dst, dst + rows), name, src))
                dst += rows
        return (dst, *shape0[1:]), pieces
    raise ValueError(f"unknown weight kind {kind!r}")


def hf_tensor_shapes(hf: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor of the HF checkpoint of ``hf`` (derived from the config alone)."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hidden // heads
    ffn, vocab = hf["intermediate_size"], hf["vocab_size"]
    family = family_for(hf)
    moe = family.moe
    if moe is not None:
        expert_ffn = hf[moe.ffn_field]
        expert_shapes = {moe.gate: (expert_ffn, hidden), moe.up: (expert_ffn, hidden), moe.down: (hidden, expert_ffn)}
        router = (num_experts(hf), hidden)
    by_suffix = {
        "embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
        "norm.weight": (hidden,), "layernorm.weight": (hidden,),
        "q_proj.weight": (heads * head_dim, hidden), "q_proj.bias": (heads * head_dim,),
        "k_proj.weight": (kv_heads * head_dim, hidden), "k_proj.bias": (kv_heads * head_dim,),
        "v_proj.weight": (kv_heads * head_dim, hidden), "v_proj.bias": (kv_heads * head_dim,),
        "o_proj.weight": (hidden, heads * head_dim), "q_norm.weight": (head_dim,), "k_norm.weight": (head_dim,),
        "gate_proj.weight": (ffn, hidden), "up_proj.weight": (ffn, hidden), "down_proj.weight": (hidden, ffn),
    }
    shapes = {}
    for name in family.hf_tensor_names(hf):
        if moe is not None and ".experts." in name:
            shapes[name] = next(shape for suffix, shape in expert_shapes.items() if name.endswith("." + suffix))
        elif moe is not None and name.endswith(moe.router.rsplit("}", 1)[1]):
            shapes[name] = router
        else:
            suffix = max((s for s in by_suffix if name.endswith(s)), key=len)  # q_norm before norm
            shapes[name] = by_suffix[suffix]
    return shapes


def megatron_shards(
    hf: Mapping[str, Any], layout: MegatronLayout, make_vocab_size_divisible_by: int = 128, layer_spec: str = "local"
) -> dict[MegatronRank, list[dict[str, LocalTensor]]]:
    """For every model position (``megatron_positions``), per virtual-pipeline chunk, the local
    tensors of its GPTModel chunk keyed by megatron's parameter name (local layer and expert
    indices, as in named_parameters()) as the model's ``layer_spec`` (``model_specs.LAYER_SPECS``)
    names it: the boxes are the same for both specs, only the fused norms' names differ. An MoE
    layer's experts: EP rank e holds experts [e*E/ep, (e+1)*E/ep), each split over ETP as a dense MLP
    over TP."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout.validate(math.lcm(layout.tp * layout.cp, layout.ep * layout.etp) * layout.pp, hf)
    positions = megatron_positions(layout)
    family = family_for(hf)
    rules = family.weight_rules(hf, layer_spec)
    shapes = hf_tensor_shapes(hf)
    config = megatron_config(hf, layout)
    padded = padded_vocab_size(hf["vocab_size"], make_vocab_size_divisible_by, layout.tp)
    heads_per_group = config.num_attention_heads // config.num_query_groups
    tied = bool(hf.get("tie_word_embeddings"))
    chunks_per_stage = layout.vpp or 1
    local_experts = (num_experts(hf) or 0) // layout.ep
    result: dict[MegatronRank, list[dict[str, LocalTensor]]] = {}
    for position in positions:
        pp_rank = position.pp
        chunks = []
        for vp in range(chunks_per_stage):
            vp_stage = vp if layout.vpp else None
            first = pp_rank == 0 and vp == 0
            last = pp_rank == layout.pp - 1 and vp == chunks_per_stage - 1
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
            tensors = {}
            for rule in rules:
                # (local name, global layer, global expert) of every copy of the rule on this chunk
                if rule.per_expert:
                    placements = [(rule.megatron.format(layer=i, expert=e), offset + i, position.ep * local_experts + e)
                                  for i in range(count) for e in range(local_experts)]
                elif rule.per_layer:
                    placements = [(rule.megatron.format(layer=i), offset + i, None) for i in range(count)]
                elif rule.megatron.startswith("embedding."):
                    placements = [(rule.megatron, None, None)] if first else []
                elif rule.megatron.startswith("output_layer."):
                    placements = [(rule.megatron, None, None)] if last and not (tied and first) else []
                else:  # final norm
                    placements = [(rule.megatron, None, None)] if last else []
                tp_rank, tp = (position.etp, layout.etp) if rule.per_expert else (position.tp, layout.tp)
                for local_name, global_layer, global_expert in placements:
                    names = [n.format(layer=global_layer, expert=global_expert) for n in rule.hf]
                    shape, pieces = rule_pieces(
                        rule.kind, names, [shapes[n] for n in names], tp_rank, tp, padded,
                        heads_per_group=heads_per_group, head_dim=config.kv_channels,
                    )
                    tensors[local_name] = LocalTensor(local_name, shape, tuple(pieces))
            chunks.append(tensors)
        result[position] = chunks
    return result


def sglang_vocab_rows(vocab_size: int, tp: int) -> int:
    """SGLang's padded vocab: a multiple of 64, or of 64*tp when 64-padding does not split evenly."""
    padded = padded_vocab_size(vocab_size, 64, 1)
    return padded if padded % tp == 0 else padded_vocab_size(vocab_size, 64, tp)


def _sglang_qkv_pieces(hf_names, hf_shapes, tp_rank: int, tp: int, head_dim: int) -> tuple[tuple[int, ...], list[Piece]]:
    """SGLang's per-rank qkv_proj: [q heads of the rank; its K heads; its V heads]. With more TP
    ranks than KV heads each rank holds one KV head, head ``rank // (tp / kv_heads)`` (replicated)."""
    q_shape, k_shape, _ = hf_shapes
    heads, kv_heads = q_shape[0] // head_dim, k_shape[0] // head_dim
    q_rows = heads // tp * head_dim
    if kv_heads >= tp:
        kv_first, kv_count = tp_rank * (kv_heads // tp), kv_heads // tp
    else:
        kv_first, kv_count = tp_rank // (tp // kv_heads), 1
    pieces, dst = [], 0
    for name, shape, start, rows in (
        (hf_names[0], q_shape, tp_rank * q_rows, q_rows),
        (hf_names[1], k_shape, kv_first * head_dim, kv_count * head_dim),
        (hf_names[2], hf_shapes[2], kv_first * head_dim, kv_count * head_dim),
    ):
        pieces.append(Piece(_rows(full_box(shape), dst, dst + rows), name, _rows(full_box(shape), start, start + rows)))
        dst += rows
    return (dst, *q_shape[1:]), pieces


def validate_sglang_tp(hf: Mapping[str, Any], tp: int, ep: int = 1) -> None:
    """Raise ValueError where SGLang cannot serve ``hf`` at TP ``tp`` and EP ``ep``
    (``sglang_tp_problem``, ``sglang_expert_problem``)."""
    for field, value, problem in (("tp", tp, sglang_tp_problem(hf, tp)), ("ep", ep, sglang_expert_problem(hf, tp, ep))):
        if problem is not None:
            raise ValueError(f"rollout {field}={value}: {problem[0]}; {problem[1]}")


def sglang_tp_problem(hf: Mapping[str, Any], tp: int, cpu: bool = False) -> tuple[str, str] | None:
    """What keeps SGLang (its CPU engine when ``cpu``) from serving ``hf`` at TP ``tp``, as
    (problem, fix); None when nothing does. Its asserts: heads % tp == 0 and (kv % tp == 0 or
    tp % kv == 0): its GPU engines replicate the KV heads over a tp above their number; its CPU
    engine pads them to a multiple of tp instead (the query heads with them), a layout the weight
    sync does not write."""
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads

    def fits(t: int) -> bool:
        return t >= 1 and heads % t == 0 and (kv % t == 0 or (t % kv == 0 and not cpu))

    if fits(tp):
        return None
    need = (f"num_key_value_heads={kv} divisible by tp on CPU (SGLang's CPU engine pads the KV heads instead of "
            "replicating them)" if cpu else
            f"num_key_value_heads={kv} divisible by tp or tp by it (KV heads are split or replicated)")
    return (f"SGLang needs num_attention_heads={heads} divisible by tp and {need}",
            f"pick tp from {[t for t in range(1, heads + 1) if fits(t)]}")


# SGLang's CPU engine pads every intermediate size to a multiple of this times tp (its default MoE
# padding, DEFAULT_MOE_PADDING_SIZE), a layout the weight sync does not write.
SGLANG_CPU_FFN_MULTIPLE = 32


def sglang_expert_problem(hf: Mapping[str, Any], tp: int, ep: int, cpu: bool = False) -> tuple[str, str] | None:
    """What keeps SGLang from serving ``hf`` with expert parallelism ``ep`` inside TP ``tp`` (its
    CPU engine when ``cpu``), as (problem, fix); None when nothing does. SGLang splits the TP group
    into ep blocks of tp/ep ranks: ep divides tp and the experts, the experts' intermediate size
    splits over tp/ep."""
    family = family_for(hf)
    if family.moe is None:
        return None if ep == 1 else (f"expert parallelism needs an MoE model; model_type={hf['model_type']!r} "
                                     "is dense", "use ep=1")
    experts, field = num_experts(hf), family.moe.ffn_field
    ffn = hf[field]
    if hf.get("tie_word_embeddings") and not family.sglang_tied_embeddings:
        return (f"tie_word_embeddings=True, and SGLang's {family.hf_architecture} has no tied embeddings (its "
                "lm_head would stay unloaded)", "untie the checkpoint (write lm_head.weight as a copy of "
                "model.embed_tokens.weight and set tie_word_embeddings=false)")

    def fits(e: int) -> bool:
        return e >= 1 and tp % e == 0 and experts % e == 0 and ffn % (tp // e) == 0

    if not fits(ep):
        return (f"does not fit tp={tp}, num_experts={experts}, {field}={ffn}: SGLang runs expert parallelism "
                f"inside the TP group, so ep must divide tp and num_experts, and {field} must split over "
                f"tp / ep", f"pick ep from {[e for e in range(1, tp + 1) if fits(e)]}")
    if cpu and ffn % (SGLANG_CPU_FFN_MULTIPLE * tp):
        return (f"{field}={ffn} is not a multiple of {SGLANG_CPU_FFN_MULTIPLE} * tp={tp}: SGLang's CPU engine pads "
                "the experts to that, a layout the weight sync does not write",
                f"use tp from {[t for t in range(1, tp + 1) if ffn % (SGLANG_CPU_FFN_MULTIPLE * t) == 0]}")
    return None


def sglang_expert_rank(rank: int, tp: int, ep: int) -> tuple[int, int]:
    """(expert-parallel rank, expert-TP rank) of SGLang TP rank ``rank``: SGLang splits a TP group
    of ``tp`` into ``ep`` consecutive blocks of tp / ep ranks (``moe_ep_rank``, ``moe_tp_rank``)."""
    return rank // (tp // ep), rank % (tp // ep)


def _sglang_expert_tensors(hf: Mapping[str, Any], layer: int, rank: int, tp: int, ep: int,
                           shapes: Mapping[str, tuple[int, ...]]) -> dict[str, LocalTensor]:
    """SGLang's fused experts of one layer on TP rank ``rank``: ``w13_weight`` [local experts,
    2 * ffn / (tp/ep), hidden] (per expert its gate rows then its up rows of the expert-TP rank) and
    ``w2_weight`` [local experts, hidden, ffn / (tp/ep)]; EP rank p holds experts
    [p * E/ep, (p+1) * E/ep)."""
    moe = family_for(hf).moe
    ep_rank, moe_tp_rank = sglang_expert_rank(rank, tp, ep)
    local = num_experts(hf) // ep
    prefix = moe.expert.format(layer=layer, expert="").rstrip(".")
    pieces: dict[str, list[Piece]] = {}
    expert_shapes: dict[str, tuple[int, ...]] = {}
    for e in range(local):
        expert = moe.expert.format(layer=layer, expert=ep_rank * local + e)
        for name, kind, hf_names in ((f"{prefix}.w13_weight", "gate_up", (f"{expert}.{moe.gate}", f"{expert}.{moe.up}")),
                                     (f"{prefix}.w2_weight", "row", (f"{expert}.{moe.down}",))):
            expert_shapes[name], expert_pieces = rule_pieces(kind, hf_names, [shapes[n] for n in hf_names],
                                                             moe_tp_rank, tp // ep, None)
            pieces.setdefault(name, []).extend(dataclasses.replace(p, dst=((e, e + 1), *p.dst)) for p in expert_pieces)
    return {name: LocalTensor(name, (local, *expert_shapes[name]), tuple(pieces[name])) for name in pieces}


def sglang_shards(hf: Mapping[str, Any], tp: int, ep: int = 1) -> dict[int, dict[str, LocalTensor]]:
    """For every SGLang TP rank, its parameters (SGLang names) as pieces of HF tensors; an MoE
    model's experts as SGLang's fused ``w13_weight``/``w2_weight`` under expert parallelism ``ep``."""
    validate_sglang_tp(hf, tp, ep)
    family = family_for(hf)
    shapes = hf_tensor_shapes(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    padded = sglang_vocab_rows(hf["vocab_size"], tp)
    result: dict[int, dict[str, LocalTensor]] = {}
    for rank in range(tp):
        tensors = {}
        for rule in family.weight_rules(hf):
            if rule.sglang is None:
                continue
            for layer in range(hf["num_hidden_layers"]) if rule.per_layer else [None]:
                names = [n.format(layer=layer) for n in rule.hf]
                name = rule.sglang.format(layer=layer)
                if rule.kind == "qkv":
                    shape, pieces = _sglang_qkv_pieces(names, [shapes[n] for n in names], rank, tp, head_dim)
                else:
                    shape, pieces = rule_pieces(rule.kind, names, [shapes[n] for n in names], rank, tp, padded)
                tensors[name] = LocalTensor(name, shape, tuple(pieces))
        if family.moe is not None:
            for layer in range(hf["num_hidden_layers"]):
                tensors.update(_sglang_expert_tensors(hf, layer, rank, tp, ep, shapes))
        result[rank] = tensors
    return result


def this_megatron_rank() -> MegatronRank:
    """This process's (pipeline, tensor, expert, expert-tensor) position in megatron's initialised
    process groups."""
    from megatron.core import parallel_state

    return MegatronRank(
        pp=parallel_state.get_pipeline_model_parallel_rank(), tp=parallel_state.get_tensor_model_parallel_rank(),
        ep=parallel_state.get_expert_model_parallel_rank(), etp=parallel_state.get_expert_tensor_parallel_rank(),
    )
