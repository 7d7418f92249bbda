"""Continuous batching: which sequences run each step, and how many tokens each computes."""
