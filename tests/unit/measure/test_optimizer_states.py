"""onegpu.measure.optimizer_states: the predicted state bytes per optimizer (against a real step: the
estimate's tests in tests/unit/training/memory/test_autobatch.py and tests/unit/measure/test_memory.py)."""
from __future__ import annotations

from onegpu.measure import optimizer_states


def test_8bit_adamw_estimate_is_a_quarter_of_adamw_on_large_tensors():
    import torch
    big, small = torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(8, 8, bias=False)
    model = torch.nn.Sequential(big, small)
    n_big, n_small = 256 * 256, 64
    # bitsandbytes: uint8 exp_avg and exp_avg_sq + one fp32 absmax per 256 elements each; fp32 below 4096 elements
    want = 2 * (n_big + 4 * n_big // 256) + 8 * n_small
    assert optimizer_states.optimizer_state_bytes(model, "adamw_bnb_8bit") == want
    assert optimizer_states.optimizer_state_bytes(model, "adamw_torch") == 8 * (n_big + n_small)


def test_torchao_low_bit_states_are_quantised_only_on_whole_blocks_of_4096_elements_or_more():
    """torchao's AdamW8bit/4bit: a parameter of 4,096 elements or more whose count is not a multiple of the
    block (256) stays two fp32 buffers; a whole-block one is its codes, a fp32 scale per block and its map."""
    assert optimizer_states.torchao_state_bytes(4096 + 64, 8) == 8 * (4096 + 64)
    assert optimizer_states.torchao_state_bytes(4096, 4) == 2 * (2048 + 4 * 16 + 4 * 16)
    assert optimizer_states.torchao_state_bytes(4095, 8) == 8 * 4095
