"""Functions that run on each rank of a multi-process test here (``parallel.spawn.run_on_ranks``
imports them by module path in every rank)."""


import torch
import torch.distributed as dist


def _row_logits(chunk, inputs, local_positions, seq_length):
    """Full-vocab (padded) logits [1, seq_length, vocab] of one row through megatron's forward-only
    schedule (one chunk per stage), gathered over TP and CP; None off the last pipeline stage."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from parallel.modules.context_parallel import undo_context_parallel_split

    collected = []

    def forward_step(data_iterator, model):
        output = model(**next(data_iterator))

        def keep(output_tensor):
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(output_tensor)
            collected.append(undo_context_parallel_split(logits, local_positions.unsqueeze(0)))
            return output_tensor.sum() * 0.0, {}

        return output, keep

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([inputs]), model=chunk,
                                num_microbatches=1, seq_length=seq_length, micro_batch_size=1, forward_only=True)
    return collected[0].detach() if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None


def _next_token_logprobs(logits, labels, vocab_size):
    return torch.log_softmax(logits[..., :vocab_size].float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def packed_logprobs(layouts, lengths, seed):
    """Per layout: each sequence's next-token log-probs from ONE packed row ("packed"), from the
    same row without packed_seq_params ("control", CP=1 only), and, at TP=PP=CP=1, from each
    sequence run alone through megatron's own local attention ("alone", the oracle). None off the
    last pipeline stage."""
    from megatron.core import parallel_state

    from model_specs.presets import hf_config_dict
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks, init_params_layout_independent
    from parallel.modules.packing import pack_sequences, unpack
    from parallel.process_groups import initialize_megatron

    hf = hf_config_dict("tiny-qwen2")
    vocab = hf["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    results = []
    for layout_kwargs in layouts:
        layout = MegatronLayout(**layout_kwargs)
        initialize_megatron(layout)

        def model(packed_sequences):
            (chunk,) = build_model_chunks(hf, layout, packed_sequences=packed_sequences)
            init_params_layout_independent([chunk], seed=7, vocab_size=vocab)
            return chunk.eval()

        chunk = model(packed_sequences=True)
        batch = pack_sequences(sequences, pad_to_multiple=layout.sequence_length_multiple())
        labels, _ = batch.next_token_targets()
        row = batch.tokens.shape[1]

        def per_sequence(logits):
            if logits is None:
                return None
            return [lp[: n - 1] for lp, n in zip(unpack(_next_token_logprobs(logits, labels, vocab), batch), lengths)]

        result = {"layout": layout_kwargs, "packed": per_sequence(_row_logits(chunk, batch.model_inputs(),
                                                                              batch.local_positions(), row))}
        if layout.cp == 1:
            plain = dict(input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None)
            result["control"] = per_sequence(_row_logits(chunk, plain, torch.arange(row), row))
        if layout == MegatronLayout():
            reference = model(packed_sequences=False)
            alone = []
            for tokens in sequences:
                inputs = dict(input_ids=tokens[None], position_ids=torch.arange(len(tokens))[None], attention_mask=None)
                logits = _row_logits(reference, inputs, torch.arange(len(tokens)), len(tokens))
                alone.append(None if logits is None else _next_token_logprobs(logits, tokens[1:][None], vocab)[0])
            result["alone"] = alone
        results.append(result)
        parallel_state.destroy_model_parallel()
    return results


def packed_loss_grads(lengths, seed):
    """TP=1: gradients of a weighted next-token log-prob loss on ONE packed row and of the sum of
    the same losses on each sequence alone (megatron's own attention), for two parameters."""
    from megatron.core import parallel_state

    from model_specs.presets import hf_config_dict
    from parallel.layout import MegatronLayout
    from parallel.models import build_model_chunks, init_params_layout_independent
    from parallel.modules.packing import pack_sequences, unpack
    from parallel.process_groups import initialize_megatron

    hf = hf_config_dict("tiny-qwen2")
    vocab = hf["vocab_size"]
    initialize_megatron(MegatronLayout())
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    weights = [torch.rand(n - 1, generator=generator) for n in lengths]
    names = ("embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight")

    def grads(packed_sequences):
        (chunk,) = build_model_chunks(hf, MegatronLayout(), packed_sequences=packed_sequences)
        init_params_layout_independent([chunk], seed=7, vocab_size=vocab)
        if packed_sequences:
            batch = pack_sequences(sequences, pad_to_multiple=4)
            labels, _ = batch.next_token_targets()
            logprobs = unpack(_next_token_logprobs(chunk(**batch.model_inputs()), labels, vocab), batch)
            loss = sum((lp[: len(w)] * w).sum() for lp, w in zip(logprobs, weights))
        else:
            loss = 0.0
            for tokens, w in zip(sequences, weights):
                logits = chunk(tokens[None], torch.arange(len(tokens))[None], None)
                loss = loss + (_next_token_logprobs(logits, tokens[1:][None], vocab)[0] * w).sum()
        loss.backward()
        params = dict(chunk.named_parameters())
        return float(loss), {name: params[name].grad.clone() for name in names}

    result = {"packed": grads(True), "separate": grads(False)}
    parallel_state.destroy_model_parallel()
    return result


def packed_oracle_tp1(lengths, seed):
    """The single-rank checks in one process (megatron's import dominates a rank's start-up)."""
    return {"logprobs": packed_logprobs([{}], lengths, seed)[0], "grads": packed_loss_grads(lengths, seed + 1)}


def vocab_parallel_slice_outputs(logits, targets, vocab_size, grad_logp, grad_entropy):
    """This TP rank's slice of full ``logits`` through ``vocab_parallel_log_probs`` (TP = world
    size): log-probs, entropy, and the gradient of sum(grad_logp * logp + grad_entropy * H)
    with respect to the slice."""
    from megatron.core import parallel_state

    from parallel.layout import MegatronLayout
    from parallel.modules.vocab_parallel import vocab_parallel_log_probs
    from parallel.process_groups import initialize_megatron

    initialize_megatron(MegatronLayout(tp=dist.get_world_size()))
    local = logits.shape[-1] // dist.get_world_size()
    mine = logits[..., dist.get_rank() * local:(dist.get_rank() + 1) * local].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_log_probs(mine, targets, vocab_size)
    ((logp * grad_logp).sum() + (entropy * grad_entropy).sum()).backward()
    parallel_state.destroy_model_parallel()
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad": mine.grad}
