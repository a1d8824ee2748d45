"""Parallel layout (degrees and rank arithmetic) and process-group initialisation."""

from megarl.parallel.layout import ParallelLayout, RankCoords

__all__ = ["ParallelLayout", "RankCoords"]
