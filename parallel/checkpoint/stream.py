"""Megatron ``torch_dist`` checkpoints written from and read into HF tensors, one shard at a time.

Neither direction builds the model's weights. Each rank builds its GPTModel chunks on the meta
device (shapes only) and asks megatron for their ``sharded_state_dict``: megatron itself decides
every checkpoint key, global shape, layer axis, swiglu split, vocab padding and replica. Each
stored shard is then related to boxes of HF tensors through the family's weight rules
(``parallel.shards``): ``ShardBoxes``.

- Writing (``save_streamed``): ``megatron.core.dist_checkpointing.save`` runs as usual (validation,
  metadata.json, common.pt, torch DCP planning and ``.metadata``) with a strategy whose writer
  fills each shard from the safetensors files only when it writes that shard, then drops it.
- Reading (``read_hf_tensors``): the shard boxes of every rank are gathered on rank 0, which
  fills each HF tensor in turn from the checkpoint files through torch DCP's storage reader
  (one stored item in memory at a time), whatever layout the checkpoint was saved at.

Peak host memory is therefore the process (imports, meta model) plus about one tensor, not the
model size. The files are what ``dist_checkpointing.save`` of the built model would write, and
``dist_checkpointing.load`` / ``parallel.checkpoint.dist_ckpt.load_megatron_checkpoint`` read them.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.hf_io import HFCheckpoint, check_chunk_names, chunks_layer_spec
from parallel.layout import MegatronLayout
from parallel.models import build_model_chunks, unwrap_model
from parallel.shards import Box, box_intersection, box_volume, megatron_shards, this_megatron_rank

# (HF tensor or None for zeros, its box, the box of the stored shard it fills)
Link = tuple[str | None, Box, Box]


@dataclasses.dataclass
class ShardBoxes:
    """One stored shard (a chunk of global tensor ``key``) as boxes of HF tensors."""

    key: str
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]  # the shard's own shape (no prepended layer axes)
    prepend: int  # leading layer axes of the global tensor (size 1 in the shard)
    main_replica: bool
    dtype: torch.dtype
    links: list[Link]

    def global_box(self) -> Box:
        sizes = (1,) * self.prepend + self.shape
        return tuple((o, o + n) for o, n in zip(self.global_offset, sizes))


def te_extra_state() -> torch.Tensor:
    """What a Transformer Engine module's ``get_extra_state`` returns when it holds no FP8 state
    (TE 2.x, which megatron-core 0.16 requires: an empty uint8 tensor; with FP8 its pickled scaling
    state), and so what a TE model's dist checkpoint stores under each linear layer's
    ``..._extra_state`` key. megatron's local linears store None there; TE 2.x loads both."""
    return torch.empty(0, dtype=torch.uint8)


def meta_chunks(hf: Mapping[str, Any], layout: MegatronLayout) -> list:
    """This rank's GPTModel chunks on the meta device: structure and shapes, no weights."""
    with torch.device("meta"):
        return build_model_chunks(hf, layout)


def _box_in_param(view: torch.Tensor, param: torch.Tensor, name: str) -> Box:
    """The box of ``param`` that ``view`` (a view of it, e.g. one swiglu half) covers."""
    if view.stride() != param.stride() or not param.is_contiguous():
        raise CheckpointError(f"{name}: megatron's shard is not a box of the parameter")
    offset = view.storage_offset() - param.storage_offset()
    start = []
    for stride in param.stride():
        start.append(offset // stride)
        offset %= stride
    box = tuple((s, s + n) for s, n in zip(start, view.shape))
    if any(b > n for (_, b), n in zip(box, param.shape)):
        raise CheckpointError(f"{name}: megatron's shard {box} is outside the parameter {list(param.shape)}")
    return box


def sharded_state_dict_with_boxes(chunks: list, hf: Mapping[str, Any], layout: MegatronLayout):
    """Megatron's sharded state dict of the (meta) chunks, factories applied, and the
    ``ShardBoxes`` of every ShardedTensor in it, keyed by (key, global offset). The chunks may be
    of either layer spec (``chunks_layer_spec``): megatron keys the fused norms
    ``...linear_qkv.layer_norm_weight`` / ``...linear_fc1.layer_norm_weight`` in both."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories, is_main_replica

    expected = megatron_shards(hf, layout, layer_spec=chunks_layer_spec(chunks))[this_megatron_rank()]
    state = {f"chunk{i}": unwrap_model(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}
    apply_factories(state)
    boxes: dict[tuple[str, tuple[int, ...]], ShardBoxes] = {}
    for index, (chunk, tensors) in enumerate(zip(chunks, expected)):
        params = dict(unwrap_model(chunk).named_parameters())
        check_chunk_names(index, set(params), set(tensors))
        seen = set()
        for name, value in state[f"chunk{index}"].items():
            shards = value if isinstance(value, list) else [value]
            if all(isinstance(s, ShardedObject) for s in shards):
                continue  # _extra_state: small objects, written as they are
            if name not in params or not all(isinstance(s, ShardedTensor) for s in shards):
                raise CheckpointError(f"chunk {index}: megatron checkpoints {name}, which is not a parameter")
            seen.add(name)
            param, local = params[name], tensors[name]
            for shard in shards:
                if shard.flattened_range is not None:
                    raise CheckpointError(f"{shard.key}: flattened shards are not supported")
                inner = _box_in_param(shard.data, param, name)
                links = []
                for piece in local.pieces:
                    common = box_intersection(piece.dst, inner)
                    if common is None:
                        continue
                    dst = tuple((a - i0, b - i0) for (a, b), (i0, _) in zip(common, inner))
                    src = () if piece.hf is None else tuple(
                        (s0 + a - d0, s0 + b - d0) for (a, b), (d0, _), (s0, _) in zip(common, piece.dst, piece.src))
                    links.append((piece.hf, src, dst))
                if sum(box_volume(dst) for _, _, dst in links) != math.prod(shard.local_shape):
                    raise CheckpointError(f"{shard.key} at {shard.global_offset}: the weight rules do not cover it")
                entry = ShardBoxes(shard.key, tuple(shard.global_offset), tuple(shard.local_shape),
                                   shard.prepend_axis_num, is_main_replica(shard.replica_id), param.dtype, links)
                boxes[(shard.key, entry.global_offset)] = entry
        if seen != set(params):
            raise CheckpointError(f"chunk {index}: parameters megatron does not checkpoint: {sorted(set(params) - seen)}")
    return state, boxes


def fill_shard(entry: ShardBoxes, ckpt: HFCheckpoint) -> torch.Tensor:
    """The data of one stored shard, read from the HF checkpoint."""
    if len(entry.links) == 1 and entry.links[0][0] is not None:  # one box of one tensor: no copy
        hf_name, src, _ = entry.links[0]
        return ckpt.read_box(hf_name, src, dtype=entry.dtype).reshape(entry.shape)
    out = torch.empty(entry.shape, dtype=entry.dtype)
    for hf_name, src, dst in entry.links:
        region = out[tuple(slice(a, b) for a, b in dst)]
        if hf_name is None:
            region.zero_()
        else:
            region.copy_(ckpt.read_box(hf_name, src))
    return out


# ----------------------------------------------------------------------------- writing


def _streaming_strategy(resolve: Callable[[str, tuple[int, ...]], torch.Tensor]):
    """megatron's torch_dist save strategy, with shard data produced by ``resolve(key, offset)``
    at the moment each shard is written (one at a time) instead of preloaded."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType

    class Planner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            sizes = tuple(write_item.tensor_data.chunk.sizes)
            return resolve(write_item.index.fqn, tuple(write_item.index.offset)).reshape(sizes)

    class Writer(FileSystemWriterAsync):
        def prepare_write_data(self, plan, planner):
            self.items, self.planner = plan.items, planner
            self.file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            self.results = []

        def write_all(self):
            """One file per rank, as megatron's writer with one thread; BYTE_IO items first."""
            if not self.items:
                return
            import os

            ordered = sorted(self.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
            with open(os.path.join(self.checkpoint_dir, self.file_name), "wb") as stream:
                for item in ordered:
                    data = self.planner.resolve_data(item)
                    self.results.append(_write_item(self.transforms, stream, data, item, self.file_name,
                                                    serialization_format=SerializationFormat.TORCH_SAVE))
                    del data
                os.fsync(stream.fileno())

        def retrieve_write_results(self):
            return self.results

    class Strategy(TorchDistSaveShardedStrategy):
        def async_save(self, sharded_state_dict, checkpoint_dir):
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            writer = Writer(checkpoint_dir, thread_count=1)
            planner = Planner(dedup_replicated_tensors=False, flatten_state_dict=False)
            (ret, *_) = save_state_dict_async_plan(pyt_state_dict, writer, None, 0, planner=planner)
            return AsyncRequest(writer.write_all, (), [lambda: save_state_dict_async_finalize(*ret)])

    return Strategy("torch_dist", 1, thread_count=1)


def save_streamed(ckpt: HFCheckpoint, layout: MegatronLayout, directory: str | Path, layer_spec: str = "local"
                  ) -> None:
    """Collective: write this layout's megatron checkpoint of ``ckpt`` into ``directory`` (exists,
    empty), each rank its own shards, one shard in memory at a time, as a model of ``layer_spec``
    saves it. The two specs' checkpoints hold the same keys (megatron-core 0.16: the norms under
    their fused TE names, an ``_extra_state`` object per linear layer and none for TE's core
    attention) and the same tensors; a TE checkpoint's extra states are TE's (``te_extra_state``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from model_specs import check_layer_spec

    check_layer_spec(layer_spec)
    state, boxes = sharded_state_dict_with_boxes(meta_chunks(ckpt.config, layout), ckpt.config, layout)
    if layer_spec == "te":
        for chunk_state in state.values():
            for name, value in chunk_state.items():
                if isinstance(value, ShardedObject) and name.endswith("._extra_state"):
                    value.data = te_extra_state()

    def resolve(key, offset):
        entry = boxes.get((key, offset))
        if entry is None:
            raise CheckpointError(f"megatron asked for {key} at {list(offset)}, which no weight rule produces")
        return fill_shard(entry, ckpt)

    dist_checkpointing.save(state, str(directory), sharded_strategy=_streaming_strategy(resolve))


# ----------------------------------------------------------------------------- reading


class _BoxLoadPlanner:
    """torch DCP load planner that copies requested boxes of stored tensors into given tensors."""

    def __init__(self, targets: dict[tuple[str, tuple[int, ...]], torch.Tensor]):
        self.targets = targets

    def resolve_tensor(self, read_item):
        from torch.distributed._shard._utils import narrow_tensor_by_index

        target = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        return narrow_tensor_by_index(target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor):
        pass

    def load_bytes(self, read_item, value):
        raise CheckpointError(f"{read_item.dest_index.fqn}: expected a tensor, the checkpoint holds bytes")


def read_hf_tensors(directory: str | Path, hf: Mapping[str, Any], layout: MegatronLayout, shared: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Collective (every rank builds its meta chunks and contributes its shard boxes): an
    iterator of (name, full HF tensor) in checkpoint order, read from the megatron checkpoint at
    ``directory`` (saved at any layout): every tensor on rank 0 and None elsewhere, or with
    ``shared`` every rank its share of the tensors (``names[rank::world]``). ``layout`` is the
    layout of this process group; it only decides how the boxes are computed."""
    from parallel.shards import hf_tensor_shapes

    _, boxes = sharded_state_dict_with_boxes(meta_chunks(hf, layout), hf, layout)
    mine = [(e.key, e.prepend, e.global_box(), hf_name, src, dst)
            for e in boxes.values() if e.main_replica for hf_name, src, dst in e.links if hf_name is not None]
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [None] * world
    if shared:
        dist.all_gather_object(gathered, mine)
    else:
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
        if rank != 0:
            return None
    by_name: dict[str, list] = {}
    for rank_links in gathered:
        for key, prepend, global_box, hf_name, src, dst in rank_links:
            by_name.setdefault(hf_name, []).append((key, prepend, global_box, src, dst))
    names = list(hf_tensor_shapes(hf))
    return _read_tensors(Path(directory), hf, by_name, names[rank::world] if shared else names)


def stored_dtype(directory: str | Path) -> torch.dtype:
    """The dtype the checkpoint's weights are stored in (that of its first tensor)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = FileSystemReader(str(directory)).read_metadata().state_dict_metadata.values()
    return next(md.properties.dtype for md in stored if isinstance(md, TensorStorageMetadata))


def _read_tensors(directory: Path, hf: Mapping[str, Any], by_name: dict[str, list], names: list[str]):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from parallel.shards import hf_tensor_shapes

    reader = FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    stored = metadata.state_dict_metadata
    shapes = hf_tensor_shapes(hf)
    for name in names:
        shape = shapes[name]
        links = by_name.get(name, [])
        dtype = stored[links[0][0]].properties.dtype if links and links[0][0] in stored else torch.float32
        full = torch.empty(shape, dtype=dtype)
        if sum(box_volume(src) for *_, src, _ in links) != full.numel():
            raise CheckpointError(f"{name}: the layout's shards cover {sum(box_volume(s) for *_, s, _ in links)} "
                                  f"of its {full.numel()} elements")
        items, targets = [], {}
        for key, prepend, global_box, src, dst in links:
            if key not in stored:
                raise CheckpointError(f"{directory}: no tensor {key} in the checkpoint (needed for {name})")
            # the box of the global tensor that holds ``src`` of the HF tensor
            offsets = [a for a, _ in global_box[:prepend]] + [
                g0 + d0 for (g0, _), (d0, _) in zip(global_box[prepend:], dst)]
            sizes = [1] * prepend + [b - a for a, b in dst]
            size = stored[key].size
            if len(size) != len(offsets) or any(o + n > s for o, n, s in zip(offsets, sizes, size)):
                raise CheckpointError(f"{directory}: {key} has shape {list(size)}, this model needs its box "
                                      f"{[(o, o + n) for o, n in zip(offsets, sizes)]}")
            target = full[tuple(slice(a, b) for a, b in src)]
            for _ in range(prepend):
                target = target.unsqueeze(0)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            targets[(key, tuple(offsets))] = target
            found = create_read_items_for_chunk_list(key, stored[key], [chunk])
            if sum(math.prod(item.lengths) for item in found) != math.prod(sizes):
                raise CheckpointError(f"{directory}: the stored chunks of {key} do not cover {list(offsets)} + {sizes}")
            items += found
        reader.read_data(LoadPlan(items), _BoxLoadPlanner(targets)).wait()
        yield name, full
