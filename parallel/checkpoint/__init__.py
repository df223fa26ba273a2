"""Checkpoints: HF safetensors IO (``hf_io``), Megatron distributed checkpoints (``dist_ckpt``),
streamed HF <-> Megatron conversion at any layout (``stream``, ``convert``) and tensor-by-tensor
verification of any two checkpoints (``verify``). Every write goes to a temporary name first
and is renamed into place when complete (``atomic``); ``errors`` holds ``CheckpointError``."""
