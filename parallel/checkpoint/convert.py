"""HF <-> Megatron weights at any TP/PP/VPP layout, driven by ``parallel.shards``.

``load_hf_into_chunks`` runs on every rank and fills that rank's model chunks from an HF
checkpoint, reading only the boxes the rank needs. ``gather_hf_tensors`` is the inverse: a
collective that yields each full HF tensor on global rank 0 (one tensor at a time, so peak
memory is the largest tensor), checking that every element was held by some rank and that
replicas (TP-replicated norms, the tied output layer) agree bit for bit. Both serve models that
are in memory anyway (the trainer, the tests).

The conversion jobs (``hf_to_megatron``, ``megatron_to_hf``) never build the weights: they
stream between the files shard by shard through ``parallel.checkpoint.stream``.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.hf_io import HFCheckpoint, check_chunk_names, chunks_layer_spec
from parallel.forward import prompt_logits
from parallel.layout import MegatronLayout
from parallel.models import init_value_head, unwrap_model, value_heads
from parallel.shards import (
    LocalTensor,
    MegatronRank,
    hf_tensor_shapes,
    megatron_position,
    megatron_shards,
    this_megatron_rank,
)


def fill_local_tensor(dst: torch.Tensor, local: LocalTensor, ckpt: HFCheckpoint) -> None:
    """Write every piece of ``local`` into ``dst`` (in place) from the checkpoint."""
    if tuple(dst.shape) != local.shape:
        raise CheckpointError(f"{local.name}: model holds shape {list(dst.shape)}, layout expects {list(local.shape)}")
    for piece in local.pieces:
        region = dst[tuple(slice(a, b) for a, b in piece.dst)]
        if piece.hf is None:
            region.zero_()
        else:
            region.copy_(ckpt.read_box(piece.hf, piece.src))


def load_hf_into_chunks(chunks: list, ckpt: HFCheckpoint, layout: MegatronLayout) -> None:
    """Fill this rank's GPTModel chunks from ``ckpt`` (call on every rank after building them);
    the chunks' parameters may be named as either layer spec names them (``chunks_layer_spec``)."""
    expected = megatron_shards(ckpt.config, layout, layer_spec=chunks_layer_spec(chunks))[this_megatron_rank()]
    with torch.no_grad():
        for index, (chunk, tensors) in enumerate(zip(chunks, expected)):
            params = dict(unwrap_model(chunk).named_parameters())
            check_chunk_names(index, set(params), set(tensors))
            for name, param in params.items():
                fill_local_tensor(param.data, tensors[name], ckpt)


def _boxes_by_hf_name(tensors_per_chunk: list[dict[str, LocalTensor]]) -> dict[str, list]:
    """hf name -> [(chunk, parameter name, piece)] in one fixed order (the shards' order), which
    every rank can compute for every other rank."""
    held: dict[str, list] = {}
    for index, tensors in enumerate(tensors_per_chunk):
        for name, tensor in tensors.items():
            for piece in tensor.pieces:
                if piece.hf is not None:
                    held.setdefault(piece.hf, []).append((index, name, piece))
    return held


def _contributing_ranks(layout: MegatronLayout, world_size: int) -> dict[int, MegatronRank]:
    """One replica of the model: the lowest rank at each model position (``megatron_position``);
    without experts the ranks of data-parallel and context-parallel index 0, with experts also
    the data-parallel ranks that hold the other expert-parallel ranks' experts."""
    first: dict[MegatronRank, int] = {}
    for rank in range(world_size):
        first.setdefault(megatron_position(rank, layout, world_size), rank)
    return {rank: position for position, rank in first.items()}


def gather_hf_tensors(chunks: list, hf: Mapping[str, Any], layout: MegatronLayout,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Collective over the world group: yields (name, full HF tensor) on rank 0 and (name, None)
    elsewhere, for every tensor of the HF checkpoint, in checkpoint order.

    Every rank knows which boxes every other rank holds (the shards are computed from the
    config), so each contributing rank sends one flat buffer per tensor to rank 0 and rank 0
    receives into buffers of known size: no pickling, one tensor in flight. The chunks'
    parameters may be named as either layer spec names them (the boxes are the same).
    """
    shards = megatron_shards(hf, layout, layer_spec=chunks_layer_spec(chunks))
    me = dist.get_rank()
    contributors = _contributing_ranks(layout, dist.get_world_size())
    boxes = {rank: _boxes_by_hf_name(shards[position]) for rank, position in contributors.items()}
    params = {}
    if me in contributors:
        for index, (chunk, tensors) in enumerate(zip(chunks, shards[contributors[me]])):
            params[index] = dict(unwrap_model(chunk).named_parameters())
            check_chunk_names(index, set(params[index]), set(tensors))
    element_dtype = next(iter(unwrap_model(chunks[0]).parameters())).dtype

    def views(rank, name):
        return [params[index][param][tuple(slice(a, b) for a, b in piece.dst)]
                for index, param, piece in boxes[rank].get(name, [])]

    for name, shape in hf_tensor_shapes(hf).items():
        if me != 0:
            mine = views(me, name) if me in contributors else []
            if mine:
                dist.send(torch.cat([v.reshape(-1) for v in mine]), dst=0)
            yield name, None
            continue
        full = torch.empty(shape, dtype=dtype or element_dtype)
        covered = torch.zeros(shape, dtype=torch.bool)
        for rank in sorted(contributors):
            pieces = boxes[rank].get(name, [])
            if not pieces:
                continue
            if rank == 0:
                data = [v.reshape(-1) for v in views(0, name)]
                flat = torch.cat(data)
            else:
                flat = torch.empty(sum(math.prod(b - a for a, b in p.src) for _, _, p in pieces), dtype=element_dtype)
                dist.recv(flat, src=rank)
            offset = 0
            for _, _, piece in pieces:
                index = tuple(slice(a, b) for a, b in piece.src)
                size = math.prod(b - a for a, b in piece.src)
                data = flat[offset: offset + size].view([b - a for a, b in piece.src]).to(full.dtype)
                offset += size
                seen = covered[index]
                if seen.any() and not torch.equal(full[index][seen], data[seen]):
                    raise CheckpointError(f"replicas of {name} box {piece.src} differ between ranks")
                full[index] = data
                covered[index] = True
        if not covered.all():
            raise CheckpointError(f"{name}: {int((~covered).sum())} elements held by no rank")
        yield name, full


def export_hf_checkpoint(chunks: list, hf: Mapping[str, Any], layout: MegatronLayout, target: str,
                         recorded_checksums: Mapping[str, str] | None = None, source: str = "") -> None:
    """Collective: write the chunks' weights as an HF checkpoint at ``target`` (rank 0 writes,
    atomically; every rank takes part in the gather). With ``recorded_checksums``, any tensor
    that differs from its recorded checksum fails the export before anything is renamed."""
    from parallel.checkpoint.hf_io import write_hf_checkpoint

    dtype = next(iter(unwrap_model(chunks[0]).parameters())).dtype
    stream = gather_hf_tensors(chunks, hf, layout)
    if recorded_checksums:
        stream = _matching_checksums(stream, recorded_checksums, source)
    if dist.get_rank() == 0:
        specs = {name: (shape, dtype) for name, shape in hf_tensor_shapes(hf).items()}
        write_hf_checkpoint(target, hf_config_for_export(hf, dtype), stream, specs)
    else:
        for _ in stream:
            pass


def hf_config_for_export(hf: Mapping[str, Any], dtype: torch.dtype) -> dict:
    """config.json of an exported checkpoint: the source config with architecture and dtype set."""
    from model_specs import family_for

    config = dict(hf)
    config["architectures"] = [family_for(hf).hf_architecture]
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config


# ----------------------------------------------------------------------------- conversion jobs


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"megarl convert: {message}", flush=True)


def peak_rss_bytes() -> int:
    """Largest resident set of any rank so far (collective). The high-water mark of this
    process's own memory (VmHWM): ``ru_maxrss`` survives exec, so a spawned rank would report
    at least its parent's resident set at the fork."""
    import resource

    try:
        with open("/proc/self/status") as status:
            own = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = torch.tensor([own], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


PROBE_POSITIONS = 256
# The probe's tolerance, relative to the logit scale. Both sides evaluate the same fp32 function
# in different orders (megatron's fused QKV and gate/up GEMMs, split over TP, its unfused softmax
# and its RoPE; HF's separate projections and SDPA), so they differ by rounding only: fp32's unit
# roundoff u = 2**-24 ~ 6e-8 times ~sqrt(n) for a reduction of length n in another order (the
# longest: the MLP's intermediate size, <= ~9k under the probe's 2e9-parameter cap; the 256
# positions of attention), summed over the L residual updates (~sqrt(L), L <= ~30 under the cap)
# and carried into the logits in proportion to their size: ~6e-8 * sqrt(9e3) * sqrt(30) ~ 3e-5 of
# the largest |logit| at most, usually far less (blocked GEMMs accumulate in many partial sums).
# Measured over 256 positions: 4e-7 of it on the tiny test models, 2e-6 on 130M-270M-parameter
# shapes (hidden 1024, intermediate 4096-8192, 4-16 layers, TP 1-2). 1e-4 of the largest |logit|
# (at least 1e-4, for near-zero logits) sits above all of that, while what the probe exists to
# catch (a misplaced head or bias, a dropped norm, RoPE with another base or scaling) moves
# logits by 1e-3 to 1 of their scale at some position (RoPE's base 10000 -> 11000 on a tiny
# model: 9e-4 of the scale at position 254, 6e-5 over the first 8 positions).
PROBE_RTOL = 1e-4


def probe_tokens(hf: Mapping[str, Any], positions: int | None = None) -> torch.Tensor:
    """The logit probe's prompt [1, n]: ``positions`` tokens, by default 256 or the model's context
    (``max_position_embeddings``) if shorter, so an error that grows with position (RoPE's base or
    scaling) shows; drawn uniformly from the vocabulary by a fixed-seed generator: the same prompt
    on every rank and every run."""
    if positions is None:
        positions = min(PROBE_POSITIONS, hf.get("max_position_embeddings") or PROBE_POSITIONS)
    return torch.randint(0, hf["vocab_size"], (1, positions), generator=torch.Generator().manual_seed(0))


def logit_probe(ckpt_dir: str, layout: MegatronLayout, hf_dir: str, max_params: float = 2e9,
                positions: int | None = None) -> str:
    """Collective: compare the logits on a fixed prompt (``probe_tokens``) of the model megatron's
    own load builds from ``ckpt_dir`` at ``layout`` with HF transformers' logits of ``hf_dir`` (on
    the last pipeline stage), within ``PROBE_RTOL`` of the logit scale. The only step of a
    conversion that holds the model's weights, so it is skipped above ``max_params``. Returns a
    one-line result; raises CheckpointError (on every rank) if the logits differ."""
    hf = HFCheckpoint(hf_dir, check_tensors=False)
    vocab = hf.config["vocab_size"]
    n_params = sum(torch.Size(hf.shape(name)).numel() for name in hf.names)
    if n_params > max_params:
        return f"logit probe skipped: {n_params / 1e9:.1f}B parameters exceed the CPU probe limit {max_params / 1e9:.1f}B"
    tokens = probe_tokens(hf.config, positions)
    from parallel.checkpoint.dist_ckpt import load_megatron_checkpoint, read_checkpoint_metadata
    from parallel.models import build_model_chunks

    chunks = build_model_chunks(read_checkpoint_metadata(ckpt_dir)["hf_config"], layout)
    load_megatron_checkpoint(chunks, ckpt_dir)
    logits = prompt_logits(chunks, tokens)
    result = torch.zeros(3, dtype=torch.float64)  # [max diff, its position, largest |HF logit|]
    if logits is not None and dist.get_rank() == dist.get_world_size() - 1:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            reference = model(tokens).logits
        per_position = (logits[..., :vocab].float().cpu() - reference).abs()[0].amax(dim=-1)
        position = int(per_position.argmax())
        result = torch.tensor([float(per_position[position]), position, float(reference.abs().max())],
                              dtype=torch.float64)
    dist.all_reduce(result)  # one rank contributed
    diff, position, scale = float(result[0]), int(result[1]), float(result[2])
    tolerance = PROBE_RTOL * max(1.0, scale)
    if not diff <= tolerance:  # NaN fails too
        raise CheckpointError(
            f"logit probe failed over {tokens.shape[1]} positions: max |megatron - HF transformers| = {diff:.3g} "
            f"at position {position} > tolerance {tolerance:.2g} ({PROBE_RTOL:g} x max(1, largest |logit| "
            f"{scale:.3g})); the two models compute different functions from these weights (a config field "
            f"read differently, or files HF transformers reads differently)")
    return (f"logit probe passed over {tokens.shape[1]} positions: max |megatron - HF transformers| = {diff:.2g} "
            f"(tolerance {tolerance:.2g})")


PARAMS_DTYPE = torch.float32  # what build_model_chunks holds and the converter stores


def _verified(out_dir: str, checks) -> str:
    """Run ``checks()`` (on a conversion's output in its partial directory) and return its result;
    a failure names the output that was not written."""
    try:
        return checks()
    except CheckpointError as error:
        raise CheckpointError(f"{out_dir} not written: {error}") from None


def hf_to_megatron(hf_dir: str, out_dir: str, layout: MegatronLayout, verify: bool = True,
                   layer_spec: str = "local") -> dict:
    """Collective: convert an HF checkpoint into a Megatron dist checkpoint, sharded at ``layout``,
    as a model of ``layer_spec`` (``model_specs.LAYER_SPECS``; see ``stream.save_streamed``) saves it.

    Streams: each rank writes its shards straight from the safetensors files, one shard in
    memory at a time (``parallel.checkpoint.stream``); no rank builds the model's weights, except the
    logit probe of the verification (capped by model size). Verification runs on the complete
    checkpoint in its partial directory: it is renamed to ``out_dir`` only if every check passed."""
    import time

    from model_specs import check_layer_spec
    from parallel.checkpoint.dist_ckpt import write_megatron_checkpoint
    from parallel.checkpoint.hf_io import INDEX_FILE, tensor_checksum
    from parallel.checkpoint.stream import read_hf_tensors, save_streamed
    from parallel.process_groups import initialize_megatron

    start = time.monotonic()
    check_layer_spec(layer_spec)
    ckpt = HFCheckpoint(hf_dir)
    layout.validate(dist.get_world_size(), ckpt.config)
    initialize_megatron(layout)
    _log(f"{hf_dir} -> {out_dir} at tp={layout.tp} pp={layout.pp} vpp={layout.vpp} on {dist.get_world_size()} rank(s), "
         f"{layer_spec} layer spec")
    if ckpt.unindexed_files:
        _log(f"not reading {[f.name for f in ckpt.unindexed_files]}: {INDEX_FILE} does not list them")
    names = list(hf_tensor_shapes(ckpt.config))
    rank, world = dist.get_rank(), dist.get_world_size()
    shares = [None] * world  # the source's checksums, each rank a share of the tensors
    dist.all_gather_object(shares, {name: tensor_checksum(ckpt.read(name).to(PARAMS_DTYPE))
                                    for name in names[rank::world]})
    checksums = {name: share[name] for share in shares for name in share}
    checksums = {name: checksums[name] for name in names}

    def write(directory):
        save_streamed(ckpt, layout, directory, layer_spec)
        if verify:  # before the rename: a checkpoint that does not read back is never put in place
            stream = read_hf_tensors(directory, ckpt.config, layout, shared=True)
            bad = [name for name, tensor in stream if tensor_checksum(tensor) != checksums[name]]
            every = [None] * world
            dist.all_gather_object(every, bad)
            bad = sorted(name for share in every for name in share)
            if bad:
                raise CheckpointError(f"{out_dir} not written: tensors read back differ from the source: {bad[:5]}")

    measured = {}

    def check(directory):  # the complete checkpoint (metadata included), before the rename
        measured["conversion_peak_rss_bytes"] = peak_rss_bytes()  # before the probe builds the model
        probe = _verified(out_dir, lambda: logit_probe(str(directory), layout, hf_dir))
        _log(f"verified: {len(checksums)} tensors read back bit-exact; {probe}")

    write_megatron_checkpoint(out_dir, ckpt.config, layout, checksums, write, check if verify else None,
                              layer_spec=layer_spec)
    _log(f"saved {out_dir} in {time.monotonic() - start:.1f} s")
    report = {"tensors": len(names), "conversion_peak_rss_bytes": measured.get("conversion_peak_rss_bytes")
              or peak_rss_bytes()}
    report.update(seconds=time.monotonic() - start, peak_rss_bytes=peak_rss_bytes())
    return report


def megatron_to_hf(ckpt_dir: str, out_dir: str, layout: MegatronLayout, verify: bool = True) -> dict:
    """Collective: export a Megatron dist checkpoint (saved at any layout, for either layer spec:
    their keys are the same) as an HF checkpoint.

    Streams: rank 0 reads one HF tensor at a time from the checkpoint files and writes it; the
    other ranks only contribute their shard boxes (and take part in the logit probe). The export
    is written to a partial directory beside ``out_dir`` (``atomic.partial_dir``), verified
    there by every rank, and renamed only if every check passed."""
    import time
    from pathlib import Path

    from parallel.checkpoint.atomic import partial_dir
    from parallel.checkpoint.dist_ckpt import read_checkpoint_metadata
    from parallel.checkpoint.hf_io import write_hf_checkpoint
    from parallel.checkpoint.stream import read_hf_tensors, stored_dtype
    from parallel.process_groups import initialize_megatron

    start = time.monotonic()
    metadata = read_checkpoint_metadata(ckpt_dir)
    hf = metadata["hf_config"]
    layout.validate(dist.get_world_size(), hf)
    initialize_megatron(layout)
    _log(f"{ckpt_dir} (saved at {metadata['saved_layout']}, {metadata.get('layer_spec', 'local')} layer spec) -> "
         f"{out_dir} via tp={layout.tp} pp={layout.pp}")
    partial = partial_dir(Path(out_dir))
    measured = {}

    def check(directory):  # collective: the complete export, before the rename
        dist.barrier()  # rank 0 has written every file
        measured["conversion_peak_rss_bytes"] = peak_rss_bytes()  # before the probe builds the model

        def checks():
            HFCheckpoint(directory)  # every tensor present with the right shape (on every rank: all fail together)
            return logit_probe(ckpt_dir, layout, str(directory))

        _log(f"verified: key coverage and shapes; {_verified(out_dir, checks)}")

    stream = read_hf_tensors(ckpt_dir, hf, layout)
    if stream is not None:
        dtype = stored_dtype(ckpt_dir)
        specs = {name: (shape, dtype) for name, shape in hf_tensor_shapes(hf).items()}
        stream = _matching_checksums(stream, metadata.get("checksums") or {}, ckpt_dir)
        write_hf_checkpoint(out_dir, hf_config_for_export(hf, dtype), stream, specs, partial=partial,
                            check=check if verify else None)
    elif verify:
        check(partial)
    dist.barrier()
    _log(f"wrote {out_dir} in {time.monotonic() - start:.1f} s")
    report = {"tensors": len(hf_tensor_shapes(hf)),
              "conversion_peak_rss_bytes": measured.get("conversion_peak_rss_bytes") or peak_rss_bytes()}
    report.update(seconds=time.monotonic() - start, peak_rss_bytes=peak_rss_bytes())
    return report


def _matching_checksums(stream, recorded: Mapping[str, str], source: str):
    """Pass tensors through, failing (before anything is renamed into place) on any tensor whose
    checksum differs from the one recorded when the checkpoint was saved."""
    from parallel.checkpoint.hf_io import tensor_checksum

    for name, tensor in stream:
        if tensor is not None and name in recorded and tensor_checksum(tensor) != recorded[name]:
            raise CheckpointError(f"{source}: {name} differs from the checksum recorded at save (corrupted?)")
        yield name, tensor


def conversion_on_rank(direction: str, source: str, target: str, layout: MegatronLayout, verify: bool,
                       layer_spec: str = "local") -> dict:
    """Entry point of one conversion rank (torch.distributed already initialised). ``layer_spec``
    is the spec an hf-to-megatron checkpoint is written for; megatron-to-hf reads either spec's."""
    from megatron.core import parallel_state

    jobs = {"hf-to-megatron": lambda: hf_to_megatron(source, target, layout, verify=verify, layer_spec=layer_spec),
            "megatron-to-hf": lambda: megatron_to_hf(source, target, layout, verify=verify)}
    try:
        return jobs[direction]()
    finally:
        parallel_state.destroy_model_parallel()


def load_hf_into_value_chunks(chunks: list, ckpt: HFCheckpoint, layout: MegatronLayout,
                              head_seed: int = 0, head_std: float | None = None) -> None:
    """Fill this rank's value chunks from an HF checkpoint: every embedding/transformer/norm weight
    as ``load_hf_into_chunks`` would; then the head: from a sequence-classification checkpoint
    with one label (a reward model) its ``score.weight``, from a causal LM (the policy's, for a
    fresh critic) lm_head is skipped and the head re-initialised by ``init_value_head``."""
    from model_specs import CLASSIFIER_HEAD, classifier_labels

    expected = megatron_shards(ckpt.config, layout, layer_spec=chunks_layer_spec(chunks))[this_megatron_rank()]
    with torch.no_grad():
        for index, (chunk, tensors) in enumerate(zip(chunks, expected)):
            params = {name: p for name, p in unwrap_model(chunk).named_parameters()
                      if not name.startswith("output_layer.")}
            tensors = {name: t for name, t in tensors.items() if not name.startswith("output_layer.")}
            check_chunk_names(index, set(params), set(tensors))
            for name, param in params.items():
                fill_local_tensor(param.data, tensors[name], ckpt)
        labels = classifier_labels(ckpt.config)
        if labels is not None:
            if labels != 1:
                raise CheckpointError(f"{ckpt.path}: a value head scores one label, this classifier has {labels}")
            for head in value_heads(chunks):
                head.weight.copy_(ckpt.read(CLASSIFIER_HEAD))
            return
    std = ckpt.config.get("initializer_range", 0.02) if head_std is None else head_std
    init_value_head(chunks, head_seed, std)
