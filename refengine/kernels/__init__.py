"""Compute kernels: attention backends behind one interface, and their torch references."""
