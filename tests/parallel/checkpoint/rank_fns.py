"""Functions that run on each rank of a multi-process test here (``parallel.spawn.run_on_ranks``
imports them by module path in every rank)."""


import psutil


def convert_roundtrip(jobs, layout_kwargs, tokens):
    """For each (hf_dir, export_dir): HF -> Megatron (this rank's shards) -> logits on ``tokens``
    -> HF export at ``export_dir``. Returns the logits per job (last pipeline stage, else None)."""
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import export_hf_checkpoint, load_hf_into_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.forward import megatron_logits
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    results = []
    for hf_dir, export_dir in jobs:
        ckpt = HFCheckpoint(hf_dir)
        chunks = build_model_chunks(ckpt.config, layout)
        for chunk in chunks:
            chunk.eval()
        load_hf_into_chunks(chunks, ckpt, layout)
        logits = megatron_logits(chunks, tokens)
        export_hf_checkpoint(chunks, ckpt.config, layout, export_dir)
        results.append(None if logits is None else logits[..., : ckpt.config["vocab_size"]])
    parallel_state.destroy_model_parallel()
    return results


def checkpoint_logits(hf_dir, ckpt_dir, layout_kwargs, tokens):
    """Load weights (from HF if ``hf_dir`` else from the Megatron checkpoint ``ckpt_dir``) at a
    layout, save them to ``ckpt_dir`` when coming from HF, and return the logits on ``tokens``."""
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import load_hf_into_chunks
    from parallel.checkpoint.dist_ckpt import load_megatron_checkpoint, read_checkpoint_metadata, save_megatron_checkpoint
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.forward import megatron_logits
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.process_groups import initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    if hf_dir:
        ckpt = HFCheckpoint(hf_dir)
        chunks = build_model_chunks(ckpt.config, layout)
        load_hf_into_chunks(chunks, ckpt, layout)
        save_megatron_checkpoint(chunks, ckpt_dir, ckpt.config, layout)
        helpers = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
        assert helpers == [], f"the save left helper processes (they would outlive a SIGKILLed saver): {helpers}"
    else:
        chunks = build_model_chunks(read_checkpoint_metadata(ckpt_dir)["hf_config"], layout)
        load_megatron_checkpoint(chunks, ckpt_dir)
    logits = megatron_logits(chunks, tokens)
    parallel_state.destroy_model_parallel()
    return logits


def convert(direction, source, target, layout_kwargs, verify=True, layer_spec="local"):
    """One rank of ``megarl convert`` (``parallel.checkpoint.convert.conversion_on_rank``)."""
    from parallel.checkpoint.convert import conversion_on_rank
    from parallel.layout import MegatronLayout

    return conversion_on_rank(direction, source, target, MegatronLayout(**layout_kwargs), verify, layer_spec)


def logit_probe(ckpt_dir, hf_dir, layout_kwargs, **probe_kwargs):
    """The conversion's logit probe of a Megatron checkpoint against an HF one: its one-line
    result, or ``FAILED: <message>`` when it refuses the pair."""
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import logit_probe
    from parallel.checkpoint.errors import CheckpointError
    from parallel.layout import MegatronLayout
    from parallel.process_groups import initialize_megatron

    layout = MegatronLayout(**layout_kwargs)
    initialize_megatron(layout)
    try:
        return logit_probe(ckpt_dir, layout, hf_dir, **probe_kwargs)
    except CheckpointError as error:
        return f"FAILED: {error}"
    finally:
        parallel_state.destroy_model_parallel()
