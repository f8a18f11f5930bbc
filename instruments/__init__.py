"""Instruments: the offline tools that make and measure what the runtime serves (concept packs, SAEs).

The runtime never imports this package (the import contracts in pyproject.toml); the ``prismgate``
command's entry and the composition root reach it, lazily, for ``prismgate concepts``, ``prismgate sae``
and the packs and SAEs a start builds or looks up for ``auto``.
"""
