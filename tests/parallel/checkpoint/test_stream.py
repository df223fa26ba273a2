"""Streamed conversion (parallel/checkpoint/stream.py) against megatron's own save and load, and its
memory bound.

Oracles: ``megatron.core.dist_checkpointing.save`` of the built, filled model (the checkpoint the
converter used to write) must give the same keys, global shapes, stored chunks, tensor
properties, metadata.json and common.pt, and the same stored values (read back by plain torch
DCP); megatron's ``load`` of the streamed checkpoint at another layout must give the source
weights bit for bit (exported by the independent gather path); the streamed round trip across
layouts (other vocab padding, tied embeddings) must give the source files. Memory: the peak RSS of a
conversion rank, as the kernel counts it (``ru_maxrss`` of the rank's own process, forked for it),
must not grow with the number of layers beyond a few of the largest tensor.
"""

import json
import math

import pytest
import torch

from model_specs.presets import hf_config_dict, save_tiny_hf_model
from parallel.checkpoint.hf_io import HFCheckpoint
from parallel.shards import hf_tensor_shapes
from parallel.spawn import run_on_ranks


def save_both_ways(hf_dir, old_dir, new_dir, layout_kwargs):
    """The same source saved by megatron's save of the built model and by the streamed writer."""
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import load_hf_into_chunks
    from parallel.checkpoint.dist_ckpt import save_megatron_checkpoint, write_megatron_checkpoint
    from parallel.checkpoint.stream import save_streamed
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    ckpt = HFCheckpoint(hf_dir)
    chunks = build_model_chunks(ckpt.config, layout)
    load_hf_into_chunks(chunks, ckpt, layout)
    save_megatron_checkpoint(chunks, old_dir, ckpt.config, layout)
    write_megatron_checkpoint(new_dir, ckpt.config, layout, None, lambda d: save_streamed(ckpt, layout, d))
    parallel_state.destroy_model_parallel()


def load_and_export(ckpt_dir, export_dir, layout_kwargs):
    """megatron's load of ``ckpt_dir`` into this layout's model, exported by the gather path."""
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import export_hf_checkpoint
    from parallel.checkpoint.dist_ckpt import load_megatron_checkpoint, read_checkpoint_metadata
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    hf = read_checkpoint_metadata(ckpt_dir)["hf_config"]
    chunks = build_model_chunks(hf, layout)
    load_megatron_checkpoint(chunks, ckpt_dir)
    export_hf_checkpoint(chunks, hf, layout, export_dir)
    parallel_state.destroy_model_parallel()


def _stored(path):
    """(.metadata's tensors as {key: (size, properties, sorted chunks)}, byte keys, every stored
    tensor read whole by torch DCP's default planner)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    tensors, objects = {}, set()
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[key] = (tuple(md.size), md.properties,
                            sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
        else:
            objects.add(key)
    values = {key: torch.empty(size, dtype=props.dtype) for key, (size, props, _) in tensors.items()}
    load(values, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return tensors, objects, values


CASES = {  # tied embeddings across pipeline stages; q/k norms with interleaved stages
    "tiny-llama-tied-tp2_pp2": ("tiny-llama-tied", {"tp": 2, "pp": 2}, 4),
    "tiny-qwen3-pp2_vpp2": ("tiny-qwen3", {"pp": 2, "vpp": 2}, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_checkpoint_is_megatrons_checkpoint(tmp_path, case):
    model, layout_kwargs, world = CASES[case]
    hf_dir = save_tiny_hf_model(model, tmp_path / "hf", seed=5)
    old, new = tmp_path / "old", tmp_path / "new"
    run_on_ranks(save_both_ways, world, hf_dir, str(old), str(new), layout_kwargs, timeout_s=300)

    old_tensors, old_objects, old_values = _stored(old)
    new_tensors, new_objects, new_values = _stored(new)
    assert new_tensors == old_tensors  # keys, global shapes, stored chunks, properties
    assert new_objects == old_objects
    for key, value in old_values.items():
        assert torch.equal(new_values[key], value), key
    assert (new / "metadata.json").read_text() == (old / "metadata.json").read_text()
    assert torch.load(new / "common.pt", weights_only=False) == torch.load(old / "common.pt", weights_only=False)
    assert json.loads((new / "megarl_checkpoint.json").read_text()) == json.loads(
        (old / "megarl_checkpoint.json").read_text())

    # megatron's own load of the streamed checkpoint at another layout: the source, bit for bit
    run_on_ranks(load_and_export, 1, str(new), str(tmp_path / "export"), {}, timeout_s=300)
    source, exported = HFCheckpoint(hf_dir).read_all(), HFCheckpoint(tmp_path / "export").read_all()
    assert source.keys() == exported.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor.to(exported[name].dtype)), name


def convert_on_ranks(direction, source, target, layout_kwargs, verify=True):
    from parallel.checkpoint.convert import conversion_on_rank
    from parallel.layout import MegatronLayout

    return conversion_on_rank(direction, source, target, MegatronLayout(**layout_kwargs), verify)


def convert_measuring_peak_rss(direction, source, target):
    """One unverified conversion rank (a fresh process; the logit probe's HF model would grow with
    the model); returns its peak RSS in bytes as the kernel counts it (``ru_maxrss``), which
    includes what it inherits from the fork server: the same for every model size."""
    import resource

    convert_on_ranks(direction, source, target, {}, verify=False)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_peak_memory_does_not_grow_with_the_model(tmp_path):
    """Two models with the same tensors, 2 and 40 layers (the larger ~20x the bytes): converting
    the larger one, both directions, may cost more than the smaller by a few of its largest
    tensors, not by its size (the built-model path needed 2.7-5.2x the model bytes)."""
    shapes = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=512, tie_word_embeddings=False)
    peaks, sizes = {}, {}
    for layers in (2, 40):
        overrides = dict(shapes, num_hidden_layers=layers)
        hf_dir = save_tiny_hf_model("tiny-llama", tmp_path / f"hf{layers}", seed=1, **overrides)
        tensors = hf_tensor_shapes(hf_config_dict("tiny-llama", **overrides)).values()
        sizes[layers] = (sum(math.prod(s) for s in tensors) * 4, max(math.prod(s) for s in tensors) * 4)
        mg, back = str(tmp_path / f"mg{layers}"), str(tmp_path / f"back{layers}")
        peaks[layers] = max(run_on_ranks(convert_measuring_peak_rss, 1, direction, source, target, timeout_s=300)[0]
                            for direction, source, target in (("hf-to-megatron", hf_dir, mg), ("megatron-to-hf", mg, back)))
    model_bytes, largest = sizes[40]
    growth = peaks[40] - peaks[2]
    assert model_bytes > 40 * largest  # the property is only visible when the model dwarfs its tensors
    # a shard in memory, its torch.save/torch.load copy and the HF tensor being assembled: <= 4 largest
    assert growth < 4 * largest + 0.05 * model_bytes, (
        f"peak RSS {peaks[2] / 2**20:.0f} MiB (2 layers) -> {peaks[40] / 2**20:.0f} MiB (40 layers, "
        f"{model_bytes / 2**20:.0f} MiB of weights, largest tensor {largest / 2**20:.1f} MiB)")


EXPORTS = {  # (model, overrides, save layout and ranks, export layout and ranks)
    # vocab 200 padded to 512 rows at TP=4 but 256 at TP=1: the reader takes the real rows only
    "tp4-padding-to-tp1": ("tiny-llama", {"num_key_value_heads": 4, "vocab_size": 200}, ({"tp": 4}, 4), ({}, 1)),
    # tied embeddings: one stored tensor, read on the first stage only
    "tied-tp1-to-pp2": ("tiny-llama-tied", {}, ({}, 1), ({"pp": 2}, 2)),
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_streamed_round_trip_across_layouts(tmp_path, case):
    model, overrides, (save_kwargs, save_world), (export_kwargs, export_world) = EXPORTS[case]
    hf_dir = save_tiny_hf_model(model, tmp_path / "hf", seed=9, **overrides)
    mg, back = str(tmp_path / "mg"), str(tmp_path / "back")
    run_on_ranks(convert_on_ranks, save_world, "hf-to-megatron", hf_dir, mg, save_kwargs, timeout_s=300)
    run_on_ranks(convert_on_ranks, export_world, "megatron-to-hf", mg, back, export_kwargs, timeout_s=300)
    source, exported = HFCheckpoint(hf_dir).read_all(), HFCheckpoint(back).read_all()
    assert source.keys() == exported.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    recorded = json.loads((tmp_path / "mg" / "megarl_checkpoint.json").read_text())["checksums"]
    assert recorded == json.loads((tmp_path / "back" / "megarl_checksums.json").read_text())
