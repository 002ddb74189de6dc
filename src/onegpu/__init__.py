"""onegpu: fine-tune Hugging Face models on one GPU through DVC and measure, in MLflow, what gradient
accumulation and activation checkpointing cost and whether they change the result."""

__version__ = "0.1.0"
