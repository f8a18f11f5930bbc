"""One codec per wire protocol. Codecs translate; the core decides."""
