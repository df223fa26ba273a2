"""Llama (2/3.x) family: untied or tied embeddings, GQA, no biases."""

from model_specs.base import ModelFamily

LLAMA = ModelFamily(name="llama", hf_model_type="llama", hf_architecture="LlamaForCausalLM")
