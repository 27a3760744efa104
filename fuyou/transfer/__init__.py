"""Data moves between the SSD store, host RAM and the device, all through fixed host buffers.

Modules in data-path order (a step: weights in, activations out and back, gradients out):

* ``host_pool`` — the fixed host buffers (pinned on CUDA) every move goes through, within the host budget.
* ``ram_tier`` — extents held in host RAM in front of the store: RAM ↔ host-buffer memcpys instead of SSD I/O.
* ``weights`` — compute weights store (or RAM tier) → host buffer → device, ``depth`` blocks ahead.
* ``activation_files`` — swapped activations device → host → SSD scratch file in forward, and back in backward.
* ``gradients`` — finished block gradients device → host buffer, on the device-to-host stream.
* ``grad_park`` — gradients awaiting their update: kept in host RAM, or host → SSD scratch file → host.
* ``futures`` — not a move: future combinators that chain the moves without blocking the training thread.

The update itself (state store → host → CPU AdamW → state and new weights → store) is the engine's
Adam stage (``fuyou.engine.adam_stage``); every move records its spans on ``fuyou.timeline``. This
package does not import ``fuyou.engine``.
"""
