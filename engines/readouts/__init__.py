"""Concept readouts: packs of unit directions, and the dot products taken inside the model."""
