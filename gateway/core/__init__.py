"""The protocol-neutral core: sessions, actions, events and errors."""
