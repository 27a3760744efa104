"""A Hugging Face causal LM as streamed blocks: ``blocks`` (the block specs: parameters, borrows,
FLOPs), ``adapters`` (the model's meta-device skeleton cut into blocks; binding a block's flat
weights to the HF modules and running it), ``lora`` (adapters on a frozen base), ``freeze`` (the
``--freeze`` rule), ``store_layout`` (a model's training state as store extents), ``description``
(the one description the planner and the engine's device admission use, derived from the skeleton
and the layout, with ``activation_rules``: what each family's blocks save for backward),
``hf_io`` (configs and safetensors checkpoints)."""
