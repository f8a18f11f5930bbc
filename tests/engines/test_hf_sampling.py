"""The transformers engine's sampling module: vLLM's penalties, logit bias, min_tokens and min_p, by hand."""

from __future__ import annotations

import pytest
import torch

from prismgate.core.actions import GenerateSpec
from prismgate.engines.hf.sampling import History, sample

EOS = 4


def shaped(spec: GenerateSpec, logits: list[float], prompt: list[int], generated: list[int]) -> list[float]:
    history = History(spec, prompt, len(logits), (EOS,))
    for t in generated:
        history.add(t)
    return history.shape(torch.tensor(logits, dtype=torch.float32)).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    spec = GenerateSpec(repetition_penalty=2.0)
    # token 0 in the prompt, token 1 generated, tokens 2 and 3 never seen
    assert shaped(spec, [4.0, -1.0, 4.0, -1.0, 0.0], [0], [1]) == [2.0, -2.0, 4.0, -1.0, 0.0]


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    spec = GenerateSpec(frequency_penalty=0.5, presence_penalty=1.0)
    # token 0 only in the prompt; token 1 generated twice, token 2 once
    assert shaped(spec, [1.0, 1.0, 1.0, 1.0, 1.0], [0], [1, 2, 1]) == [1.0, -1.0, -0.5, 1.0, 1.0]


def test_logit_bias_adds_and_min_tokens_masks_the_stop_ids_until_enough_are_out() -> None:
    spec = GenerateSpec(logit_bias=((2, 3.0), (3, -1.5)), min_tokens=2, stop_token_ids=(1,))
    inf = float("-inf")
    assert shaped(spec, [0.0] * 5, [], [0]) == [0.0, inf, 3.0, -1.5, inf]  # the stop id and EOS, 1 of 2 out
    assert shaped(spec, [0.0] * 5, [], [0, 0]) == [0.0, 0.0, 3.0, -1.5, 0.0]
    ignoring = GenerateSpec(min_tokens=2, ignore_eos=True)
    assert shaped(ignoring, [0.0] * 5, [], []) == [0.0] * 5  # EOS does not stop, so it is not held back


def test_greedy_takes_the_argmax_of_the_shaped_logits() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([5.0, 4.0, 0.0, 0.0, 0.0])
    spec = GenerateSpec(frequency_penalty=2.0)
    history = History(spec, [], 5, (EOS,))
    history.add(0)
    assert sample(logits, GenerateSpec(), generator) == 0
    assert sample(logits, spec, generator, history) == 1  # 5 - 2 < 4


@pytest.mark.parametrize("seed", range(5))
def test_min_p_drops_tokens_below_its_share_of_the_likeliest(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    # after temperature 1: probabilities 0.5, 0.25, 0.25 * 0.2 ... ; min_p 0.4 keeps 0 and 1 only
    logits = torch.log(torch.tensor([0.5, 0.25, 0.1, 0.1, 0.05]))
    spec = GenerateSpec(temperature=1.0, min_p=0.4)
    draws = {sample(logits, spec, generator) for _ in range(50)}
    assert draws <= {0, 1} and draws == {0, 1}
