"""The ``data`` section: where the rows come from, how they are split and tokenized (:class:`DataConfig`),
the packaged sources, and the section's own combinations (:func:`check_data`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from onegpu.config.knobs import IN_KEY, SEED, SHARE, OutOfKey, fail, knob, positive_or_null

PACKAGED_DATA = "bbcnews"
# The same corpus as instruction data: prompt = the article body, completion = its headline
# (onegpu.data.prompt_completion).
PACKAGED_HEADLINES = "bbcnews-headlines"
# The same articles as preference pairs: chosen = the article's headline, rejected = another article's of the
# same topic (onegpu.data.preference).
PACKAGED_PAIRS = "bbcnews-headline-pairs"
# The same articles as prompts with a verifiable answer: the headline and first paragraph -> the BBC News section
# (onegpu.data.prompt_answer; GRPO's demonstration set).
PACKAGED_SECTIONS = "bbcnews-sections"
PACKAGED_SOURCES = (PACKAGED_DATA, PACKAGED_HEADLINES, PACKAGED_PAIRS, PACKAGED_SECTIONS)
# File types data.source may name.
TABLE_SUFFIXES = (".csv", ".jsonl", ".parquet")


@dataclass
class DataConfig:
    source: str = knob(PACKAGED_DATA, key=IN_KEY, help=(
        "bbcnews (packaged BBC News) | bbcnews-headlines (article -> headline) | bbcnews-headline-pairs "
        "(preference pairs) | bbcnews-sections (article -> its section), a .csv/.jsonl/.parquet file or a "
        "<label>/*.txt folder"))
    text_column: str = knob("text", key=IN_KEY, help="for .csv/.jsonl/.parquet sources")
    label_column: str = knob("label", key=IN_KEY, help="for .csv/.jsonl/.parquet sources")
    max_length: int = knob(64, key=IN_KEY, help="tokens per example after truncation",
                           rule=(lambda v: 8 <= v <= 8192, "must be an integer from 8 to 8192, got {v}"))
    validation_size: float = knob(0.1, key=IN_KEY, help="share of the de-duplicated rows, stratified by label",
                                  rule=SHARE)
    test_size: float = knob(0.2, key=IN_KEY, help="share of the de-duplicated rows, stratified by label",
                            rule=SHARE)
    max_train_samples: int | None = knob(None, key=IN_KEY, help="cap on training examples (null = all)",
                                         rule=(positive_or_null, "must be a positive integer or null (= all), "
                                                                  "got {v}"))
    max_eval_samples: int | None = knob(None, key=OutOfKey("evaluation data only"),
                                        help="cap on validation and test examples (null = all)",
                                        rule=(positive_or_null, "must be a positive integer or null (= all), "
                                                                 "got {v}"))
    seed: int = knob(42, key=IN_KEY, help="split and subsampling seed", rule=SEED)
    # Instruction data (TRL's names; columns prompt + completion, or messages, detected as TRL does). In the
    # key when on (equivalence/key.py drops them at their defaults: keys made before they existed stay).
    completion_only_loss: bool | None = knob(None, key=IN_KEY, help=(
        "loss on the completion tokens only; null = on for prompt-completion data"))
    assistant_only_loss: bool = knob(False, key=IN_KEY, help="messages data: loss on the assistant turns only")
    padding_free: bool = knob(False, help=(
        "each micro-batch flattened into one row with position_ids: no compute on padding, same training"),
        key=OutOfKey("the same examples in the same micro-batches and steps, flattened into one row per "
                     "micro-batch with position_ids; attention stays within each sequence (refused where a "
                     "model cannot keep them apart), so the same losses and gradients up to summation order"))
    packing: bool = knob(False, key=IN_KEY, help=(
        "examples packed into rows of max_length, sequences kept apart: another training"))


# -- validation: each key's rule (declared with the key), then the combinations of each section ----------

def check_data(d: DataConfig, source: str) -> None:
    """The split sizes together, and ``data.source``'s form (the file itself is read by prepare)."""
    if d.validation_size + d.test_size >= 0.9:
        fail(source, "data.test_size", "data.validation_size + data.test_size must leave at least 10% "
              f"for training, got {d.validation_size} + {d.test_size}")
    allowed = (f"'{PACKAGED_DATA}', '{PACKAGED_HEADLINES}', '{PACKAGED_PAIRS}', '{PACKAGED_SECTIONS}', a .csv, .jsonl "
               "or .parquet file, or a directory of <label>/*.txt files")
    if not d.source:
        fail(source, "data.source", f"must be {allowed}")
    if (d.source not in PACKAGED_SOURCES and not d.source.lower().endswith(TABLE_SUFFIXES)
            and not Path(d.source).expanduser().is_dir() and Path(d.source).suffix):
        fail(source, "data.source", f"must be {allowed}, got {d.source!r}")
