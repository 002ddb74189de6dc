"""bench.same_training's job and report: one-word answers after prompts of 3-30 words, and what compare says."""
from __future__ import annotations

from bench import same_training as st


def test_the_job_has_one_word_answers_after_prompts_of_3_to_30_words():
    rows = st.yes_no_rows(32)
    words = [len(p.split(":", 1)[1].split()) for p in rows["prompt"]]
    assert min(words) == 3 and max(words) == 30
    assert set(rows["completion"]) == {"yes", "no"}


def _run(label: str, micro: int, losses, norms, pf: bool = False) -> dict:
    return {"label": label, "micro": micro, "accum": 8 // micro, "padding_free": pf, "backend": "trainer",
            "fused": label != "whole", "rows": [{"step": i + 1, "loss": x, "grad_norm": g, "targets": 24}
                                                 for i, (x, g) in enumerate(zip(losses, norms))]}


def test_the_report_gives_step_1_apart_and_compares_verdict_with_its_cause():
    whole = _run("whole", 8, [2.0, 1.5, 1.2], [10.0, 8.0, 6.0])
    same = _run("fused 2x4", 2, [2.0, 1.5 * (1 + 2e-7), 1.2], [10.0 * (1 + 1e-7), 8.0, 6.0])
    off = _run("fused 1x8", 1, [2.0, 1.5, 1.2], [10.0 * (1 + 7.4e-5), 8.0, 6.0])
    text = "\n".join(st.report_lines([whole, same, off]))
    assert "| fused 2x4 | 0.0e+00       | 1.0e-07" in text
    assert "| fused 1x8 | 0.0e+00       | 7.4e-05" in text
    assert "fused 1x8 at step 1 (grad_norm 7.4e-05 relative, beyond the noise floor of the first step), likely " \
           "cause: train.fused_lm_head differs (true vs false)" in text
    assert "| fused 2x4 | equivalent" in text
