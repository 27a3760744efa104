"""Fuyou: full-parameter fine-tuning of LLMs larger than GPU memory, with SSD-resident state.

Read the packages in their import order — each uses only those above it:

1. ``device`` — the CPU/CUDA backend seam (the only place that touches ``torch.cuda``); on CPU, the
   allocation meter that counts what a GPU would hold.
2. ``schedule`` — plain data (no torch): the ``Plan``, the step's rules, host sizing and the one
   device-memory model.
3. ``optim`` — the CPU AdamW (numba kernel, reference, worker thread).
4. ``storage`` — SSD-resident tensors: extents, I/O backends, checksums, the versioned store.
5. ``models`` — a Hugging Face model as streamed blocks, how their state is laid out in the store,
   and its one description (shapes, FLOPs, and each block's device memory measured on fake tensors).
6. ``transfer`` — the moves: store ↔ host buffers (pinned on CUDA) ↔ device, for weights, gradients,
   activations; the host-RAM tier.
7. ``engine`` — one training step executing a ``Plan``: forward, turnaround, backward, Adam hand-off.
8. ``planner`` — the cost model that simulates the same step and searches for the fastest ``Plan``
   (its ``measure`` times the engine's own blocks for a quick profile).
9. ``checkpoint`` — copy-free checkpoints and exact resume.
10. ``data`` — datasets → packed token batches (the model's tokenizer).
11. Front ends: ``run`` (a fine-tuning run, as ``fuyou finetune`` drives it), ``integrations``
    (``FuyouTrainer`` for Hugging Face ``Trainer``); the CLI lives in the top-level ``cli`` package.
    The library above them never imports them.

``timeline`` (per-resource spans), ``units``, ``errors`` and ``machine`` (the per-machine cache) are
shared helpers.
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``from fuyou import FuyouTrainer, FuyouTrainingArguments`` imports transformers only when asked."""
    if name in ("FuyouTrainer", "FuyouTrainingArguments"):
        from fuyou.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'fuyou' has no attribute {name!r}")
