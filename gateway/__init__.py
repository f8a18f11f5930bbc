"""prismgate: one model, many protocols, and a look inside."""

__version__ = "0.1.0"
