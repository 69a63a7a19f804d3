"""The model card (README.md): the hub's YAML metadata, what the model is, how to load and fine-tune it, its config."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from huggingface_hub import ModelCard, ModelCardData

from xl.hub.files import data_settings

if TYPE_CHECKING:
    from xl.hub import PretrainedXL

# The tags PyTorchModelHubMixin's own card gives (the hub counts the integration by them), and what the model does.
TAGS = ["model_hub_mixin", "pytorch_model_hub_mixin", "text-generation", "transformer-xl"]


def model_card(model: PretrainedXL) -> ModelCard:
    metadata = ModelCardData(library_name="xl", pipeline_tag="text-generation", tags=TAGS)
    return ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n{card_text(model)}")


def card_text(model: PretrainedXL) -> str:
    training = model.about.get("training") or {}
    trained = ""
    if training.get("steps") is not None:
        trained = f" It was trained for {training['steps']:,} steps"
        trained += f" on {training['corpus']}" if training.get("corpus") else ""
        trained += f", in segments of {training['tgt_len']} tokens" if training.get("tgt_len") else ""
        trained += "."
    n_params = sum(p.numel() for p in model.parameters())
    name = model.tokenizer.name if model.tokenizer is not None else "no"
    rows = [f"| `{key}` | `{json.dumps(value)}` |" for key, value in flat(model.config.to_dict())]
    rows += [f"| evaluation `{key}` | `{json.dumps(value)}` |" for key, value in
             flat(model.about.get("evaluation") or {})]
    settings = data_settings(model.tokenizer, "START") if model.tokenizer is not None else ""
    return f"""# Transformer-XL language model

A Transformer-XL language model (Dai et al., 2019: segment-level recurrence with relative positions) trained with
xl, a Transformer-XL framework on PyTorch Lightning and Hydra: {n_params:,} parameters, a {name} tokenizer of
{model.config.vocab_size:,} ids.{trained}

## Use

```python
from xl.hub import PretrainedXL

model = PretrainedXL.from_pretrained("REPO")  # this repository's id, or the folder's path
ids = model.tokenizer.encode("Some text")
```

Fine-tune it: `python -m xl.convert REPO START` writes a run folder, then
`python train.py init_from=START data=… {settings}` trains a new run from its weights.

## Config

| setting | value |
|---|---|
{chr(10).join(rows)}
"""


def flat(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A nested config as (dotted key, value) pairs."""
    pairs: list[tuple[str, Any]] = []
    for key, value in values.items():
        pairs += flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]
    return pairs
