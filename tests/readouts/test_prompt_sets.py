"""The prompt sets shipped in the repo: well formed, big enough, balanced."""

from __future__ import annotations

import json

from prismgate.instruments.packs.build import PROMPT_SETS_DIR
from prismgate.instruments.packs.prompt_sets import load_prompt_sets

REQUIRED = {"sentiment", "formality", "question", "code", "refusal", "french"}


def test_shipped_prompt_sets_are_complete_and_balanced() -> None:
    sets = load_prompt_sets([PROMPT_SETS_DIR])
    names = {s.name for s in sets}
    assert names >= REQUIRED
    for s in sets:
        assert json.loads((PROMPT_SETS_DIR / f"{s.name}.json").read_text())["name"] == s.name
        assert len(s.positive) >= 32 and len(s.negative) >= 32, s.name
        assert len(s.positive) == len(s.negative), f"{s.name}: pairs are matched by index"
        assert len(set(s.positive)) == len(s.positive) and len(set(s.negative)) == len(s.negative), s.name
        assert not set(s.positive) & set(s.negative), s.name
        assert s.description, s.name
        # Matched pairs: lengths comparable on average, so length is not what the direction learns.
        mean_pos = sum(map(len, s.positive)) / len(s.positive)
        mean_neg = sum(map(len, s.negative)) / len(s.negative)
        assert 0.6 < mean_pos / mean_neg < 1.7, (s.name, mean_pos, mean_neg)
