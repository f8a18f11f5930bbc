"""The embedded engine: PyTorch + transformers, on CPU or one GPU."""

from prismgate.engines.hf.engine import TransformersEngine

__all__ = ["TransformersEngine"]
