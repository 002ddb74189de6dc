"""Tokenization of the split texts (unpadded; padding happens per micro-batch in the collator)."""
from __future__ import annotations

from onegpu.errors import DataError

# A tokenizer model_max_length at or above this means "no limit" (transformers uses 1e30 when unset).
NO_LIMIT = 1_000_000


def tokenize(dsd, tokenizer, max_length: int, task: str = "sequence-classification"):
    """Add ``input_ids``/``attention_mask`` (truncated to ``max_length``, unpadded) and ``length``.

    Padding happens per micro-batch in the collator, so a micro-batch is only as long as its longest row.
    For causal LM each text ends with the tokenizer's EOS token (when it has one) before truncation.

    Raises:
        DataError: ``max_length`` is above the tokenizer's ``model_max_length`` (the model's limit).
    """
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and limit < NO_LIMIT and max_length > limit:
        raise DataError(f"data.max_length={max_length} is longer than the model's limit of {limit} tokens "
                        f"(its tokenizer's model_max_length): longer rows would overflow its position "
                        f"embeddings; set data.max_length to at most {limit}")
    eos = tokenizer.eos_token if task == "causal-lm" and tokenizer.eos_token else ""

    def fn(batch):
        texts = [t + eos for t in batch["text"]] if eos else batch["text"]
        enc = tokenizer(texts, truncation=True, max_length=max_length)
        enc["length"] = [len(x) for x in enc["input_ids"]]
        return enc
    return dsd.map(fn, batched=True, desc="tokenize")
