"""Out-of-memory recovery (``train.oom_retry``), the same for both backends.

After an out-of-memory error in an optimizer step, the step's gradients are dropped and all its
micro-batches are redone, each cut into twice as many pieces; later steps keep the finer split. Every
piece's loss is divided by the whole step's item count, so any split of the step gives the same gradient
(float rounding aside): the run stays equivalent.
"""
from __future__ import annotations


def _flat(inputs: dict) -> bool:
    """A padding-free micro-batch: one row of sequences told apart by ``position_ids``."""
    return "position_ids" in inputs and "attention_mask" not in inputs and int(inputs["input_ids"].shape[0]) == 1


def rows(inputs: dict) -> int:
    """Examples in one collated micro-batch: its rows, or the sequences of a padding-free row (one host
    sync; called only on an out-of-memory error or by a test's injector)."""
    if _flat(inputs):
        return int(inputs["position_ids"].eq(0).sum())
    return int(inputs["input_ids"].shape[0])


def _runs(n: int, pieces: int, group: int) -> list:
    """``range(n)`` cut into at most ``pieces`` runs of whole groups of ``group`` (int64 index tensors)."""
    import torch
    units = torch.arange(n // group).tensor_split(min(pieces, max(n // group, 1)))
    return [torch.arange(int(u[0]) * group, (int(u[-1]) + 1) * group) for u in units if len(u)]


def _flat_pieces(inputs: dict, pieces: int, group: int) -> list[dict]:
    """A padding-free row cut between sequences into at most ``pieces`` pieces of whole groups of sequences:
    its ``(1, tokens)`` tensors by token, its per-sequence ``(sequences,)`` tensors (DPO's precomputed
    ``ref_logps``) by sequence."""
    width = int(inputs["input_ids"].shape[1])
    starts = inputs["position_ids"][0].eq(0).nonzero().flatten().tolist() + [width]
    n = len(starts) - 1

    def piece(first: int, last: int) -> dict:
        out = {}
        for k, v in inputs.items():
            if hasattr(v, "shape") and v.dim() == 2:
                v = v[:, starts[first]:starts[last + 1]]
            elif hasattr(v, "shape") and v.dim() == 1 and v.shape[0] == n:
                v = v[first:last + 1]
            out[k] = v
        return out
    return [piece(int(g[0]), int(g[-1])) for g in _runs(n, pieces, group)]


def cut(inputs: dict, pieces: int, group: int = 1) -> list[dict]:
    """``inputs`` (one collated micro-batch) cut along the row dimension into at most ``pieces`` pieces
    (a padding-free row between its sequences), each of whole groups of ``group`` rows or sequences (the
    objective's ``sequences_per_item``: a preference pair's chosen and rejected stay together), tensors of one
    value per row or sequence with them; tensors without that leading dimension are passed whole."""
    rows = int(inputs["input_ids"].shape[0])
    if pieces == 1:
        return [inputs]
    if _flat(inputs):
        return _flat_pieces(inputs, pieces, group)
    return [{k: v[idx] if hasattr(v, "shape") and v.dim() > 0 and v.shape[0] == rows else v
             for k, v in inputs.items()} for idx in _runs(rows, pieces, group)]


def recover(error, model, micro: int, pieces: int, accum: int, step: int, enabled: bool,
            events: list[dict]) -> int:
    """After out-of-memory ``error`` at optimizer step ``step`` (micro-batch ``micro`` rows cut in ``pieces``
    pieces, ``accum`` accumulation): drop the gradients, free cached memory and return the next number
    of pieces per micro-batch (twice as many).
    The event (``step``, ``old`` and ``new`` split as "m x a", ``micro_batch``) is appended to ``events``
    and printed.

    Raises:
        torch.OutOfMemoryError: ``enabled`` (``train.oom_retry``) is false (the error itself).
        UserError: the micro-batch cannot be cut further (its pieces are one row already).
    """
    import gc

    from onegpu.errors import UserError
    from onegpu.measure import memory
    if not enabled:
        raise error
    if pieces * 2 > micro:
        raise UserError(f"out of memory at optimizer step {step} even with micro-batch {max(1, micro // pieces)}: "
                        "no smaller split is left; lower data.max_length, turn train.gradient_checkpointing on, "
                        "or use a smaller model") from error
    model.zero_grad(set_to_none=True)
    gc.collect()
    memory.empty_cache()
    old, new = (micro // pieces, accum * pieces), (micro // (pieces * 2), accum * pieces * 2)
    events.append({"step": step, "old": f"{old[0]} x {old[1]}", "new": f"{new[0]} x {new[1]}",
                   "micro_batch": new[0]})
    print(f"out of memory at optimizer step {step}: redoing the step with micro-batch {new[0]} x {new[1]} "
          f"accumulation (was {old[0]} x {old[1]}); same effective batch, same result", flush=True)
    return pieces * 2


def injected(injector, step: int, piece: dict) -> None:
    """Tests: raise an injected out-of-memory error when ``injector(step, examples in piece)`` says so."""
    if injector is not None and injector(step, rows(piece)):
        import torch
        raise torch.OutOfMemoryError(f"injected out-of-memory (step {step}, {rows(piece)} rows)")
