"""Fuyou: full-parameter fine-tuning of LLMs larger than GPU memory, with SSD-resident state.

The data path, stage by stage: ``storage`` (SSD-resident tensors) → ``transfer`` (pinned host
buffers) → ``device`` (the CPU/CUDA backend seam) → ``optim`` (CPU AdamW).
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``from fuyou import FuyouTrainer, FuyouTrainingArguments`` imports transformers only when asked."""
    if name in ("FuyouTrainer", "FuyouTrainingArguments"):
        from fuyou.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'fuyou' has no attribute {name!r}")
