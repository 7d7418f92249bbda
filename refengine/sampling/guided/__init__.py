"""Grammar-constrained sampling: backends (xgrammar, llguidance), the compile cache, and the
step's token bitmask."""

from refengine.sampling.guided.base import CompiledGuide, GrammarBackend, GuidedSpecError, GuideMatcher
from refengine.sampling.guided.bitmask import allocate_bitmask, apply_bitmask
from refengine.sampling.guided.compiler import GuideCompiler, backend_modes

__all__ = ["CompiledGuide", "GrammarBackend", "GuideCompiler", "GuideMatcher", "GuidedSpecError",
           "allocate_bitmask", "apply_bitmask", "backend_modes"]
