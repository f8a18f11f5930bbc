"""Engines: the contract, the pool, and the implementations that run models."""
