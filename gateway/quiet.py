"""The libraries' console noise that a user cannot act on, turned off once per process.

Progress bars (the weights load in about a second), transformers' advice to model authors, and
transformers' deprecation of the ``past_key_values`` argument the engines pass (it would otherwise
print on the first request, or in the middle of a ``prismgate generate --readouts`` table).
The ``prismgate`` command calls it: ``serve`` and ``generate`` through the log set-up, ``concepts`` before it runs.
"""

from __future__ import annotations

import os
import warnings

# the engines pass ``past_key_values``, which every transformers the pin allows takes (``cache`` is the new name)
_PAST_KEY_VALUES = r"`past_key_values` is deprecated"


def quiet_libraries(*, debug: bool) -> None:
    """Progress bars off, transformers' warnings off (unless ``--log-level debug``), one deprecation ignored."""
    # Read when huggingface_hub / tqdm are first imported, which is after this (the CLI
    # configures logging before it loads an engine); transformers is told directly below.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"
    warnings.filterwarnings("ignore", message=_PAST_KEY_VALUES, category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency; vLLM-only images have it too
        return
    hf_logging.disable_progress_bar()
    if not debug:
        hf_logging.set_verbosity_error()
