"""Functions that run on each rank of a multi-process test here (``parallel.spawn.run_on_ranks``
imports them by module path in every rank)."""


def shared_prefix_logits(hf_dir, tokens, position_ids, segments):
    """Logits [rows, s, vocab] of shared-prefix rows (``parallel.modules.shared_prefix``) through a
    Megatron model loaded from ``hf_dir`` at TP=PP=1."""
    import torch
    from megatron.core import parallel_state

    from parallel.checkpoint.convert import load_hf_into_chunks
    from parallel.checkpoint.hf_io import HFCheckpoint
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks
    from parallel.modules.shared_prefix import rotary_positions
    from parallel.process_groups import initialize_megatron

    layout = MegatronLayout()
    initialize_megatron(layout)
    ckpt = HFCheckpoint(hf_dir)
    (model,) = build_model_chunks(ckpt.config, layout, shared_prompts=True)
    load_hf_into_chunks([model], ckpt, layout)
    model.eval()
    with torch.no_grad(), rotary_positions(model, position_ids):
        logits = model(tokens, position_ids, attention_mask=segments)
    parallel_state.destroy_model_parallel()
    return logits[..., : ckpt.config["vocab_size"]]
