"""The core's rules for features: the spec's own limits, the manifest check, the readouts permission."""

from __future__ import annotations

import pytest

from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.errors import Code, GatewayError
from prismgate.core.features import FeatureManifest, FeatureSpec, check_features
from prismgate.core.principal import Principal

MANIFEST = FeatureManifest(layers=(4, 9), widths=(512, 256), labels=({}, {}))


def test_the_layers_default_to_every_sae_and_ids_stay_under_the_narrowest() -> None:
    assert check_features(MANIFEST, "m", FeatureSpec(top_k=4)) == (4, 9)
    assert check_features(MANIFEST, "m", FeatureSpec(top_k=4, layers=(4,), ids=(300,))) == (4,)
    with pytest.raises(GatewayError, match=r"outside the SAE's features \[0, 256\)"):
        check_features(MANIFEST, "m", FeatureSpec(ids=(300,)))
    with pytest.raises(GatewayError, match="has no sparse autoencoder loaded"):
        check_features(None, "m", FeatureSpec())


def test_a_key_without_readouts_may_not_read_features() -> None:
    spec = GenerateSpec(features=FeatureSpec(ranges=(PositionRange(0, 4),)))
    with pytest.raises(GatewayError) as info:
        Principal("viewer", readouts=False).check_spec(spec)
    assert info.value.code is Code.PERMISSION_DENIED
    Principal("full").check_spec(spec)
    Principal("viewer", readouts=False).check_spec(GenerateSpec(features=FeatureSpec()))  # no positions: nothing read
