"""Where a causal LM keeps what prismgate hooks: its decoder layers and its residual width.

One module for every reader of a model's structure (the transformers engine, vLLM's worker,
the instruments), so a new model family is taught in one place.
"""

from __future__ import annotations

from typing import Any

# Where causal LMs keep their decoder layers: transformers' text models, transformers'
# vision-language models, and vLLM's model classes (plain and multimodal).
_LAYER_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers", "language_model.layers")


def decoder_layers(model: Any) -> Any:
    """The list of decoder layers of a causal LM, in transformers or inside vLLM's worker."""
    for path in _LAYER_PATHS:
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise TypeError(f"cannot find decoder layers in {type(model).__name__}")


def hidden_size(model: Any) -> int:
    """The residual stream's width of a transformers model (its text part, for a vision-language one)."""
    return int(model.config.get_text_config().hidden_size)
