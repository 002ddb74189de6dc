"""The model: resolving ``model.name_or_path``, building and loading (:mod:`.loader`), the packaged
chat model (:mod:`.packaged`) and LoRA adapters (:mod:`.lora`)."""
