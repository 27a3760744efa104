"""Fuyou: full-parameter fine-tuning of LLMs larger than GPU memory, with SSD-resident state.

Read the packages in this order — the data path, then what decides and drives it:

1. ``storage`` — SSD-resident tensors: extents, I/O backends, checksums, the versioned store.
2. ``models`` — a Hugging Face model as streamed blocks, and how their state is laid out in the store.
3. ``transfer`` — the moves: store ↔ host buffers (pinned on CUDA) ↔ device, for weights, gradients,
   activations; the host-RAM tier.
4. ``device`` — the CPU/CUDA backend seam (the only place that touches ``torch.cuda``).
5. ``optim`` — the CPU AdamW (numba kernel, reference, worker thread).
6. ``schedule`` — the ``Plan`` and the step's rules and host sizing, plain data (no torch).
7. ``engine`` — one training step executing a ``Plan``: forward, turnaround, backward, Adam hand-off.
8. ``planner`` — the cost model that simulates the same step and searches for the fastest ``Plan``.
9. ``checkpoint`` — copy-free checkpoints and exact resume.
10. Front ends: ``run`` (a fine-tuning run, as ``fuyou finetune`` drives it), ``integrations``
    (``FuyouTrainer`` for Hugging Face ``Trainer``); the CLI lives in the top-level ``cli`` package.
    The library below them never imports them.

``data`` (datasets → packed token batches), ``timeline`` (per-resource spans), ``units``, ``errors``
and ``machine`` (the per-machine cache) are shared helpers.
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``from fuyou import FuyouTrainer, FuyouTrainingArguments`` imports transformers only when asked."""
    if name in ("FuyouTrainer", "FuyouTrainingArguments"):
        from fuyou.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'fuyou' has no attribute {name!r}")
