"""Out-of-memory recovery (onegpu.training.lifecycle.oom): a micro-batch cut into pieces, the recovery's event and
its limits, the injected error of the tests. (Both backends' recovery end to end: test_autobatch.)"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onegpu.errors import UserError  # noqa: E402
from onegpu.training.lifecycle import oom  # noqa: E402


def _batch(rows: int = 5) -> dict:
    return {"input_ids": torch.arange(rows * 3).reshape(rows, 3), "attention_mask": torch.ones(rows, 3),
            "labels": torch.arange(rows), "num_items": torch.tensor(7)}


def test_cut_splits_the_rows_and_passes_other_tensors_whole():
    b = _batch(5)
    assert oom.cut(b, 1) == [b]
    parts = oom.cut(b, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [3, 2]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), b["input_ids"])
    assert torch.equal(torch.cat([p["labels"] for p in parts]), b["labels"])
    assert all(p["num_items"] is b["num_items"] for p in parts)  # a 0-d tensor has no rows to cut
    assert len(oom.cut(b, 8)) == 5  # never more pieces than rows


def test_cut_keeps_each_preference_pair_whole_padded_and_flattened():
    """3 pairs (6 rows, chosen and rejected alternating) in 2 pieces: 2 pairs and 1, never a pair split."""
    from onegpu.training.objectives.dpo import PreferenceCollator
    rows = [{"prompt_ids": [1, 2], "chosen_ids": [3] * (i + 1), "rejected_ids": [4]} for i in range(3)]
    padded, flat = PreferenceCollator(0)(rows), PreferenceCollator(0, flattened=True)(rows)
    assert [p["input_ids"].shape[0] for p in oom.cut(padded, 2, group=2)] == [4, 2]
    assert [int(p["position_ids"].eq(0).sum()) for p in oom.cut(flat, 2, group=2)] == [4, 2]
    assert [p["input_ids"].shape[0] for p in oom.cut(padded, 8, group=2)] == [2, 2, 2]  # a pair at most
    assert [p["input_ids"].shape[0] for p in oom.cut(padded, 2)] == [3, 3]  # (rows alone would split pair 1)


def test_cut_takes_each_sequences_precomputed_reference_with_it_padded_and_flattened():
    """DPO's precomputed ``ref_logps`` (one per sequence) follows its sequences into their piece; it was passed
    whole to every piece of a padding-free row (a shape error in the loss at the retry)."""
    from onegpu.training.objectives.dpo import PreferenceCollator
    rows = [{"prompt_ids": [1, 2], "chosen_ids": [3] * (i + 1), "rejected_ids": [4],
             "ref_chosen_logps": -1.0 - i, "ref_rejected_logps": -10.0 - i} for i in range(3)]
    for batch in (PreferenceCollator(0)(rows), PreferenceCollator(0, flattened=True)(rows)):
        assert [p["ref_logps"].tolist() for p in oom.cut(batch, 2, group=2)] == [[-1.0, -10.0, -2.0, -11.0],
                                                                                 [-3.0, -12.0]]


def _model():
    m = torch.nn.Linear(2, 1)
    m(torch.ones(1, 2)).sum().backward()
    return m


def test_recover_drops_the_gradients_and_doubles_the_pieces_with_one_event(capsys):
    model, events = _model(), []
    error = torch.OutOfMemoryError("CUDA out of memory")
    assert oom.recover(error, model, micro=8, pieces=1, accum=2, step=3, enabled=True, events=events) == 2
    assert model.weight.grad is None
    assert events == [{"step": 3, "old": "8 x 2", "new": "4 x 4", "micro_batch": 4}]
    assert oom.recover(error, model, micro=8, pieces=2, accum=2, step=3, enabled=True, events=events) == 4
    assert events[-1] == {"step": 3, "old": "4 x 4", "new": "2 x 8", "micro_batch": 2}
    out = capsys.readouterr().out
    assert "out of memory at optimizer step 3: redoing the step with micro-batch 4 x 4 accumulation (was 8 x 2)" in out


def test_recover_raises_the_error_when_off_and_says_so_when_no_smaller_split_is_left():
    error = torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.OutOfMemoryError):
        oom.recover(error, _model(), micro=8, pieces=1, accum=1, step=1, enabled=False, events=[])
    with pytest.raises(UserError, match="out of memory at optimizer step 2 even with micro-batch 1: no smaller split"):
        oom.recover(error, _model(), micro=4, pieces=4, accum=1, step=2, enabled=True, events=[])


def test_the_injector_raises_only_where_it_says():
    piece = {"input_ids": torch.zeros(4, 3, dtype=torch.long)}
    oom.injected(None, 1, piece)
    oom.injected(lambda step, rows: step == 2, 1, piece)
    with pytest.raises(torch.OutOfMemoryError, match="step 2, 4 rows"):
        oom.injected(lambda step, rows: step == 2, 2, piece)
    flat = {"input_ids": torch.zeros(1, 7, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]])}
    with pytest.raises(torch.OutOfMemoryError, match="step 2, 3 rows"):  # a padding-free row: its sequences
        oom.injected(lambda step, rows: rows == 3, 2, flat)
