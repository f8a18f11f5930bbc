"""How many tokens a turn may decode, and whether it fits the model's context.

One rule for every protocol, so that the same request is answered the same way
whichever wire it came on:

* a client that names ``max_tokens`` gets exactly that, or RESOURCE_EXHAUSTED
  (:class:`ContextOverflow`) when the prompt plus ``max_tokens`` would pass the
  model's context; nothing is silently clamped;
* a client that names none gets its protocol's default (a setting) capped by the room
  left in the context, or all the room left when the protocol's default is "as much as
  fits" (``None``: OpenAI's rule);
* a prompt that leaves no room at all is RESOURCE_EXHAUSTED before anything runs.
"""

from __future__ import annotations

from prismgate.core.errors import Code, GatewayError, invalid

AS_MUCH_AS_FITS = None
"""A protocol default for ``max_tokens``: all the room left in the context."""


class ContextOverflow(GatewayError):
    """RESOURCE_EXHAUSTED: the prompt (plus the decode budget) does not fit the model's context.

    ``prompt_tokens`` is None when the prompt was refused by its size, before tokenizing.
    """

    def __init__(self, message: str, *, context: int, prompt_tokens: int | None = None, max_tokens: int = 0) -> None:
        super().__init__(Code.RESOURCE_EXHAUSTED, message)
        self.context = context
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens

    @classmethod
    def of(cls, prompt_tokens: int, max_tokens: int, context: int) -> ContextOverflow:
        if prompt_tokens > context:
            message = f"the prompt has {prompt_tokens} tokens, more than the model's context of {context}"
        else:
            message = (
                f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} = {prompt_tokens + max_tokens} "
                f"exceeds the model's context of {context}"
            )
        return cls(message, context=context, prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def max_tokens_for(requested: int | None, *, prompt_tokens: int, context: int, default: int | None) -> int:
    """The decode budget of a turn whose prompt is ``prompt_tokens`` long (see the module's rule)."""
    room = context - prompt_tokens
    if requested is not None and requested < 0:
        raise invalid(f"max_tokens must be >= 0, got {requested}")
    if requested is not None:
        check_fit(prompt_tokens, requested, context)
        return requested
    if room <= 0:
        raise ContextOverflow.of(prompt_tokens, 1, context)
    return room if default is AS_MUCH_AS_FITS else min(default, room)


def check_fit(prompt_tokens: int, max_tokens: int, context: int) -> None:
    """The prompt and the whole decode budget fit the context; decoding needs a prompt."""
    if prompt_tokens > context or prompt_tokens + max_tokens > context:
        raise ContextOverflow.of(prompt_tokens, max_tokens, context)
    if max_tokens > 0 and prompt_tokens == 0:
        raise invalid("cannot decode from an empty timeline: append at least one token")
