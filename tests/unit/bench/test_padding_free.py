"""bench.padding_free's data: the lead-paragraph headlines (uneven lengths) and the share of padding."""
from __future__ import annotations

import json

import pytest

from bench.padding_free import padding_share, write_leads


def test_padding_share_counts_each_micro_batch_padded_to_its_longest():
    # one micro-batch of 2: 10 + 6 real tokens in 2 x 10 -> 4 padding of 20; two micro-batches of 1: none
    assert padding_share([10, 6], 2, 0) == pytest.approx(0.2)
    assert padding_share([10, 6], 1, 0) == 0.0


def test_lead_rows_keep_the_instruction_the_first_paragraph_and_the_headline(tmp_path):
    from onegpu.data import prompt_completion as pc
    rows = [json.loads(line) for line in write_leads(tmp_path).read_text().splitlines()]
    full = pc.headlines()
    assert len(rows) == len(full) and {r["label"] for r in rows} == set(full.labels)
    first, whole = rows[0], full.records()[0]
    assert first["completion"] == whole["completion"] and first["prompt"].startswith(pc.HEADLINE_INSTRUCTION)
    lead = first["prompt"].removeprefix(pc.HEADLINE_INSTRUCTION)
    assert lead and "\n\n" not in lead and whole["prompt"].startswith(first["prompt"] + "\n\n")
    assert len(whole["prompt"]) > 3 * len(first["prompt"])  # the article is much longer than its lead
