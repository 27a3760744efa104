"""Fuyou: full-parameter fine-tuning of LLMs larger than GPU memory, with SSD-resident state.

The data path, stage by stage: ``storage`` (SSD-resident tensors) → ``transfer`` (pinned host
buffers) → ``device`` (the CPU/CUDA backend seam) → ``optim`` (CPU AdamW).
"""

__version__ = "0.1.0"
