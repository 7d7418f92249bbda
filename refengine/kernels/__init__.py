"""Compute kernels, each with a torch reference: attention backends behind one
interface (``attention/``), prepacked projections (``linear.py``), fused elementwise
layer steps (``fused.py``), and the native CPU sources they load (``cpu/``)."""
