"""``train.fsdp``: FSDP2 sharding (torch's ``torch.distributed.fsdp.fully_shard``) over the processes of a
launch, for the ``accelerate`` backend (:mod:`onegpu.training.backends.accelerate`).

Each of the N processes keeps 1/N of every weight, gradient and optimizer state (dim-0 shards, DTensors on a
one-dimensional device mesh of the world: gloo on a CPU, NCCL on GPUs). A transformer block (the model's
``_no_split_modules`` classes, as accelerate's transformer auto-wrap policy finds them) gathers its weights
(all-gather) just before its forward and backward and reduce-scatters its gradients after backward; the root
holds what is left (embeddings, final norm, head). accelerate itself does not engage FSDP on a CPU (its
``DistributedType.FSDP`` is set only for GPUs), so this module calls torch's ``fully_shard`` directly, on
every device.

What keeps it the same training as data parallel (and one process): the ranks' gradients are averaged by
the reduce-scatter as DDP's all-reduce averages them (the loss scaling is the same); under gradient
accumulation :func:`gradient_sync` is FSDP2's ``set_requires_gradient_sync(False)`` (DDP's ``no_sync`` is
a silent no-op on an FSDP2 module) so the micro-batches accumulate unsharded gradients and the last one
reduce-scatters their sum; the norm that is logged and clipped is the *global* one (:func:`global_norm`: a
DTensor norm's ``full_tensor()``, never the local shard's). ``models/`` is a plain model (:func:`gather`).
"""
from __future__ import annotations

import contextlib
import copy


def blocks(model) -> list:
    """The modules that get a ``fully_shard`` of their own, outermost first: every submodule whose class is in
    some submodule's ``_no_split_modules`` (transformers' repeated blocks: ``LlamaDecoderLayer``, ``BertLayer``,
    ``GPT2Block``...); an empty list for a model that names none (then the root alone is sharded)."""
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def meta_copy(model):
    """A copy of ``model`` whose parameters are on the meta device (no memory), ties kept, buffers copied: the
    plain skeleton that :func:`gather` fills with the trained weights. Take it before :func:`shard`."""
    import torch
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def shard(model, device_type: str, reshard_after_forward: bool):
    """``fully_shard`` each of :func:`blocks` and then the root, on a mesh of every process of the initialized
    process group; in place (the module's class becomes an ``FSDPModule``, its parameters DTensors). Call it
    before the optimizer is built (the optimizer holds the sharded parameters).

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL): where the shards live.
        reshard_after_forward: free a block's gathered weights after its forward (gathered again in backward);
            False keeps them until backward (more memory, one all-gather less per block and step).
    Returns:
        The number of blocks sharded on their own (the root not counted).
    Raises:
        RuntimeError: no process group is initialized.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if not dist.is_initialized():
        raise RuntimeError("train.fsdp: FSDP2 needs the launch's process group, and none is initialized")
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    found = blocks(model)
    for block in reversed(found):  # innermost first, if blocks nest
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return len(found)


def gradient_sync(model, sync: bool):
    """The context of one micro-batch's forward and backward: ``sync`` False (all but a step's last) turns
    FSDP2's gradient reduce-scatter off for it (``set_requires_gradient_sync(False)``: the unsharded gradients
    accumulate), and on again on exit, so the last micro-batch reduce-scatters the step's summed gradients."""
    if sync:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def unsynced():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return unsynced()


def global_norm(norm):
    """The whole gradient's norm from ``clip_grad_norm_``'s result: a DTensor norm over sharded gradients made
    whole (``full_tensor()``: every rank's shards counted, not this rank's alone, which would be low by up to
    sqrt(N)); a plain tensor or number as it is."""
    from torch.distributed.tensor import DTensor
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def gather(model, skeleton):
    """The trained weights as a plain model: every rank takes part in gathering the full state dict
    (``get_model_state_dict`` with ``full_state_dict=True, cpu_offload=True``: rank 0 receives it on the CPU,
    the others nothing), and rank 0 puts it into ``skeleton`` (:func:`meta_copy` of the model before
    sharding; tied weights stay tied) and returns it; the other ranks return ``model`` (sharded; they write
    no outputs).

    Raises:
        KeyError: a parameter of the skeleton is missing from the gathered state dict.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return model
    new = {id(p): torch.nn.Parameter(full[name].detach().clone(), requires_grad=p.requires_grad)
           for name, p in skeleton.named_parameters()}  # each tensor once, under its first name
    for module in skeleton.modules():
        for key, p in module._parameters.items():
            if p is not None:
                module._parameters[key] = new[id(p)]
    with torch.no_grad():
        for name, b in skeleton.named_buffers():
            if name in full:
                b.copy_(full[name])
    return skeleton
