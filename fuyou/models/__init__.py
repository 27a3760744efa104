"""A Hugging Face causal LM as streamed blocks: ``blocks`` (the block specs: parameters, borrows,
FLOPs), ``adapters`` (binding a block's flat weights to the HF modules and running it), ``hf_io``
(configs and safetensors checkpoints), ``store_layout`` (a model's training state as store extents)."""
