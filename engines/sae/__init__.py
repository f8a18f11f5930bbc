"""Sparse autoencoders (SAEs): loading SAELens's on-disk format, encoding, and training a small one."""
