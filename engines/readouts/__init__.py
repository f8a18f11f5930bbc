"""Concept readouts at serve time: packs of unit directions, and the dot products taken inside the model."""
