"""refengine: a compact reference inference engine for the OpenEngine v0.1.0 contract."""

__version__ = "0.1.0"
