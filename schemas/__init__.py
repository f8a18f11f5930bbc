"""Wire schemas and the code generated from them."""
