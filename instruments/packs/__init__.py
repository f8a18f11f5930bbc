"""Concept packs made and measured: prompt sets, capture, directions, held-out report, steering range, CLI."""
