"""Sparse autoencoders (SAEs) at serve time: loading SAELens's on-disk format, encoding, feature capture."""
