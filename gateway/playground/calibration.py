"""The playground's colour scale and steering defaults, read from the concept pack.

Readouts reach the page as raw values and the manifests carry each concept's center, but not how
far from the center counts as far. The pack's ``scales`` (half the gap between its positive and
negative prompts' mean readout, see :mod:`prismgate.engines.readouts.pack`) are that yardstick,
fixed per concept and layer, so a shade means the same in every answer. They are read from the
same file the engine loaded, and used only if that file still describes what the engine serves.
So is the pack's measured steering (where each concept steers and how hard,
:class:`~prismgate.engines.readouts.pack.SteeringRange`), which the sliders start from.
"""

from __future__ import annotations

import functools
from pathlib import Path

from prismgate.compose import concept_pack_for
from prismgate.core.engine import ReadoutManifest
from prismgate.core.errors import GatewayError
from prismgate.engines.readouts.pack import ConceptPack, SteeringRange
from prismgate.settings import Settings

Scales = list[list[float]]


def scales_for(settings: Settings, manifest: ReadoutManifest, served_default: bool) -> Scales | None:
    """``[layer][concept]`` scales of the served pack, or None (no pack, an older pack, or another pack)."""
    pack = served_pack(settings, manifest, served_default)
    if pack is None or pack.scales is None:
        return None
    return [[float(v) for v in row] for row in pack.scales]


def steering_for(settings: Settings, manifest: ReadoutManifest, served_default: bool) -> dict[str, SteeringRange]:
    """The served pack's measured steering per concept; empty for a pack built before it was measured."""
    pack = served_pack(settings, manifest, served_default)
    return {} if pack is None or pack.steering is None else pack.steering


def served_pack(settings: Settings, manifest: ReadoutManifest, served_default: bool) -> ConceptPack | None:
    """The pack file the engine loaded, if it still describes what the engine serves (else None)."""
    path = concept_pack_for(settings, served_default=served_default)
    if path is None:
        return None
    try:
        stat = path.stat()
        return _matching_pack(path.resolve(), stat.st_mtime_ns, stat.st_size, manifest)
    except (OSError, GatewayError):
        return None


@functools.lru_cache(maxsize=4)
def _matching_pack(path: Path, _mtime_ns: int, _size: int, manifest: ReadoutManifest) -> ConceptPack | None:
    pack = ConceptPack.load(path)
    if (pack.layers, pack.concepts) != (manifest.layers, manifest.concepts):
        return None
    return pack
