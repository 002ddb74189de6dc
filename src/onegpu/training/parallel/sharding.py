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


def owners(model) -> dict[int, object]:
    """``id(parameter) -> module`` whose ``fully_shard`` holds it (as :func:`shard` calls it: each of :func:`blocks`
    innermost first, then the root): the innermost block that contains the parameter, else ``model`` (the root:
    embeddings, final norm, head, and a tied weight that two of them share)."""
    held: dict[int, object] = {}
    for block in reversed(blocks(model)):
        for p in block.parameters():
            held.setdefault(id(p), block)
    return {id(p): held.get(id(p), model) for p in model.parameters()}


def per_rank_bytes(model, processes: int, accumulation: int, optim: str,
                   reshard_after_forward: bool = True) -> dict[str, int]:
    """Predicted bytes one rank holds under FSDP2 (:func:`shard`) over ``processes`` ranks, from the unsharded
    model (no process group needed). A prediction, from FSDP2's design (the PyTorch docs of ``fully_shard``;
    Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"), not a measurement:

        shard(p)    = ceil(dim0 / N) x (the other dims) elements: FSDP2 pads dim 0 to a multiple of N, so this
                      is rank 0's share, the largest
        params      = sum over parameters of shard(p) x its element size
        grads       = the same over trainable parameters when gradient_accumulation_steps is 1; above 1 every
                      trainable parameter's whole (unsharded) gradient, held until the step's last micro-batch
                      (set_requires_gradient_sync(False), :func:`gradient_sync`)
        optimizer   = :func:`onegpu.measure.optimizer_states.tensor_state_bytes` of each trainable shard's shape
        gathered    = the two largest blocks' unsharded params (the block running and the next one, which FSDP2
                      prefetches: 2 x a block when the blocks are alike) + the root's own unsharded params
                      (outside every block: the root keeps them gathered from its forward to its backward); with
                      reshard_after_forward false every block keeps its gathered weights from its forward to its
                      backward: the whole params

    Left out: a block's unsharded gradients before their reduce-scatter, the collectives' buffers, and the
    allocator's slack. Activations are not here: each rank runs its own micro-batch, as without sharding.

    Args:
        processes: train.num_processes (N), the ranks of the 1-D mesh.
        accumulation: gradient_accumulation_steps of the step.
        optim: train.optim.
    Returns:
        ``{"mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes", "mem_gathered_bytes"}``, bytes per rank.
    Raises:
        ValueError: ``processes`` or ``accumulation`` below 1.
    """
    import math

    from onegpu.measure.optimizer_states import tensor_state_bytes
    if processes < 1 or accumulation < 1:
        raise ValueError(f"processes and accumulation must be >= 1, got {processes} and {accumulation}")
    held = owners(model)
    params = grads = states = 0
    unsharded: dict[int, int] = {}  # id(module) -> bytes of its parameters, gathered
    for p in model.parameters():  # each tensor once (a tied weight counted once)
        shape = tuple(p.shape) or (1,)
        local = (math.ceil(shape[0] / processes), *shape[1:])
        params += math.prod(local) * p.element_size()
        unsharded[id(held[id(p)])] = unsharded.get(id(held[id(p)]), 0) + p.numel() * p.element_size()
        if p.requires_grad:
            grads += (math.prod(local) if accumulation == 1 else p.numel()) * p.element_size()
            states += tensor_state_bytes(local, optim)
    root = unsharded.pop(id(model), 0)
    gathered = root + sum(sorted(unsharded.values())[-2 if reshard_after_forward else 0:])
    return {"mem_params_bytes": params, "mem_grads_bytes": grads, "mem_optimizer_bytes": states,
            "mem_gathered_bytes": gathered}


def per_rank_estimate(model, est: dict, train) -> dict:
    """``onegpu estimate``'s ``est`` (:func:`onegpu.training.memory.autobatch.estimate`, bytes for the whole model)
    for one rank under ``train.fsdp`` (``train``: the TrainConfig): params, grads and optimizer states from
    :func:`per_rank_bytes` and each micro-batch's total with them and the gathered weights; the activations as they
    are (each rank runs its own micro-batch). Under ``per_device_train_batch_size: auto`` each micro-batch m has
    its own gradient_accumulation_steps, effective_batch_size / (m x N), so its own gradients. Adds ``ranks`` (N),
    ``mem_gathered_bytes``, ``gathered_what`` (which weights, in words) and ``grads_accumulating`` (whether the
    states' gradients are the unsharded ones, at the first micro-batch)."""
    n = train.num_processes

    def accumulation(m: int) -> int:
        if train.per_device_train_batch_size != "auto":
            return train.gradient_accumulation_steps
        return max(1, -(-train.effective_batch_size // (m * n)))

    def at(m: int) -> dict[str, int]:
        return per_rank_bytes(model, n, accumulation(m), train.optim, train.fsdp.reshard_after_forward)
    whole = sum(est["states"].values())
    rows = [{**r, "total": r["total"] - whole + sum(at(r["micro_batch"]).values())} for r in est["rows"]]
    first = at(est["rows"][0]["micro_batch"])
    gathered = first.pop("mem_gathered_bytes")
    return {**est, "states": first, "rows": rows, "ranks": n, "mem_gathered_bytes": gathered,
            "grads_accumulating": accumulation(est["rows"][0]["micro_batch"]) > 1,
            "gathered_what": "two blocks' and the root's own" if train.fsdp.reshard_after_forward else
            "every block's, kept from its forward to its backward: reshard_after_forward false"}


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

    The root (embeddings, final norm, head) never reshards after its forward: its gathered weights stay from its
    forward to its backward's reduce-scatter (:func:`per_rank_bytes` counts them so), as torch does for a root
    whose ``reshard_after_forward`` is left unset (torch 2.13, ``fsdp/_fully_shard/_fsdp_state.py``,
    ``FSDPState._lazy_init``: "For the root, do not reshard after forward since for training, the parameters
    would be freed and all-gathered immediately"). The fused LM head relies on it
    (:mod:`onegpu.training.objectives.lm_head`): it projects with ``lm_head.weight`` after the forward, and a gathered
    group's modules hold its whole parameters (``FSDPParam.to_unsharded``: ``_setattr_on_modules``, on every
    module that shares a tied weight), whose gradients the root's post-backward reduce-scatters at the end of
    backward (``FSDPState._root_post_backward_final_callback``). A model that runs no backward (DPO's frozen
    reference) gives them back with :func:`release`.

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
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # the root: gathered until its backward
    return len(found)


def release(model) -> None:
    """Free the gathered weights of every sharded module of ``model`` (FSDP2's ``FSDPModule.reshard()``, each
    module's own group: not recursive), the root's included, which :func:`shard` keeps gathered after a forward
    until a backward reshards it: for a sharded model that runs forwards only (DPO's frozen reference). No
    collective; its next forward gathers again. A plain model: nothing."""
    import sys
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing in this process is sharded
    for module in model.modules() if fsdp is not None else ():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()


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


def is_sharded(model) -> bool:
    """Whether ``model`` is sharded by :func:`shard` (an ``FSDPModule``: its forward gathers weights with every
    process, so every process must run as many forwards)."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def full_state(model) -> dict:
    """The whole state dict of a sharded ``model`` on the CPU, on rank 0 (``get_model_state_dict`` with
    ``full_state_dict=True, cpu_offload=True``); ``{}`` on the other ranks. Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gather(model, skeleton):
    """The trained weights as a plain model: every rank takes part in gathering the full state dict
    (:func:`full_state`: rank 0 receives it on the CPU, the others nothing), and rank 0 puts it into
    ``skeleton`` (:func:`meta_copy` of the model before sharding; tied weights stay tied) and returns it; the
    other ranks return ``model`` (sharded; they write no outputs).

    Raises:
        KeyError: a parameter of the skeleton is missing from the gathered state dict.
    """
    import torch
    import torch.distributed as dist
    full = full_state(model)
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
