"""``train.activation_offloading``: the tensors a forward pass saves for backward move to host memory
and come back for backward (TRL's ``activation_offloading``, torchtune's ``OffloadActivations``: pinned
host memory, a separate CUDA stream overlapping the copies with compute, at most 5 tensors in flight).

Offloading moves bytes, not values: the same training (out of the equivalence key). It frees the device
of the activations (``mem_activation_bytes``) for PCIe traffic each step; CUDA only (the config refuses
it on a CPU, where the activations already are in host memory).
"""
from __future__ import annotations

import contextlib


def context(model, enabled: bool):
    """The context to run each micro-batch's forward and backward in: TRL's offloading context for
    ``model`` (``trl.models.get_act_offloading_ctx_manager``, as ``SFTTrainer`` builds it; reusable across
    steps), or a no-op when ``enabled`` is False."""
    if not enabled:
        return contextlib.nullcontext()
    from trl.models import get_act_offloading_ctx_manager
    return get_act_offloading_ctx_manager(model, warn_if_no_head=False)
