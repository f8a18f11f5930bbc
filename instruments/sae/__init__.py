"""Sparse autoencoders made: the training corpus, training, feature labels and the ``prismgate sae`` CLI."""
