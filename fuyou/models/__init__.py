"""A Hugging Face causal LM as streamed blocks: ``blocks`` (the block specs: parameters, borrows,
FLOPs), ``adapters`` (the model's meta-device skeleton cut into blocks; binding a block's flat
weights to the HF modules and running it), ``lora`` (adapters on a frozen base), ``freeze`` (the
``--freeze`` rule), ``store_layout`` (a model's training state as store extents), ``activation_probe`` (each block's
device memory — saved tensors, transients — measured on its own modules on fake tensors),
``description`` (the one description the planner and the engine's device admission use, derived
from the skeleton, the layout and the probe; ``activation_rules``: the family's rule where a block
cannot run on fake tensors), ``hf_io`` (configs and safetensors checkpoints), ``hub`` (hub ids)."""
