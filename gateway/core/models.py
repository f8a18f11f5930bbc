"""Which models are served and whether one can take requests: one owner for both answers.

Every protocol resolves a model name here, so they agree: a name this server does not
serve is NOT_FOUND (naming what it does serve), and a served model that is still
loading is UNAVAILABLE (a retry will succeed once the server reports ready).
"""

from __future__ import annotations

from prismgate.core.engine import EngineInfo, ReadoutManifest, VisionTokens
from prismgate.core.errors import Code, GatewayError, invalid, precondition, quote
from prismgate.core.health import Health, HealthState
from prismgate.core.pool import EnginePool

LOADING = "the model is still loading; retry once the server reports ready"


class UnknownModel(GatewayError):
    """NOT_FOUND for a model name this server does not serve; codecs may phrase it their wire's way."""

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(
            Code.NOT_FOUND,
            f"model {quote(model)} is not served here; this server serves " + ", ".join(repr(m) for m in served),
        )
        self.model = model
        self.served = list(served)


def no_concept_pack(model: str) -> GatewayError:
    """INVALID_ARGUMENT: readouts asked of a model that has no concept pack loaded."""
    return invalid(f"model {model!r} has no concept pack loaded, so it has no readouts")


class Models:
    """The served models, by name, as codecs see them (the pool behind them stays the core's)."""

    def __init__(self, pool: EnginePool, *, specials_in_text: bool = False) -> None:
        self._pool = pool
        self._specials_in_text = specials_in_text

    @property
    def specials_in_text(self) -> bool:
        """Whether a control token's string in a client's text is that control token (the setting
        ``allow_special_tokens_in_text``; off: it is text, so no client can forge a turn)."""
        return self._specials_in_text

    @property
    def names(self) -> list[str]:
        return self._pool.models

    @property
    def default(self) -> str:
        return self._pool.default_model

    @property
    def ready(self) -> bool:
        """Every engine has loaded its model (the server reports ready)."""
        return self._pool.health().ready

    def health(self) -> dict[str, Health]:
        """Each served model's state, by name (for ``/readyz`` and the metrics)."""
        return {name: self._pool.health_of(name) for name in self.names}

    def require_ready(self) -> None:
        """UNAVAILABLE until the server is ready (the reason says why): checked before a connection takes a session."""
        health = self._pool.health()
        if not health.ready:
            loading = health.state is HealthState.LOADING
            raise GatewayError(Code.UNAVAILABLE, LOADING if loading else f"the server is not serving: {health.reason}")

    def sizes(self) -> tuple[int, int] | None:
        """(largest hidden size, largest context) among the loaded models; None before any has loaded.

        A model without a concept pack has no hidden size to steer, so it counts as 0 there.
        """
        infos = [info for name in self.names if (info := self._pool.engine(name).info) is not None]
        if not infos:
            return None
        hidden = max((i.readouts.hidden_size for i in infos if i.readouts is not None), default=0)
        return hidden, max(i.max_model_len for i in infos)

    def resolve(self, model: str | None) -> str:
        """The served model's name (``None``: the default model)."""
        if model is None:
            return self.default
        if model not in self.names:
            raise UnknownModel(model, self.names)
        return model

    def info(self, model: str | None = None) -> EngineInfo:
        info = self._pool.engine(self.resolve(model)).info
        if info is None:  # engines fill ``info`` in start(); the server answers while the model loads
            raise GatewayError(Code.UNAVAILABLE, LOADING)
        return info

    def readouts(self, model: str | None = None) -> ReadoutManifest:
        """The model's readout manifest; INVALID_ARGUMENT when it has no concept pack."""
        info = self.info(model)
        if info.readouts is None:
            raise no_concept_pack(info.model_id)
        return info.readouts

    def image_tokens(self, data: bytes, mime: str, model: str | None = None) -> tuple[int, VisionTokens]:
        """How many image-pad tokens ``data`` becomes, and the ids that frame its run.

        Lets a client size an image's placeholder block before sending it, instead of
        guessing the model's image processing. A text-only model is FAILED_PRECONDITION.
        Blocking (decodes the image): call it from a worker thread.
        """
        info = self.info(model)
        if info.vision is None:
            raise precondition(f"model {info.model_id!r} takes no images (it has no vision encoder)")
        return self._pool.engine(info.model_id).image_tokens(data, mime), info.vision
