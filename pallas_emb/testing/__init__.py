"""Helpers that tests and benchmarks share (HLO inspection, bit comparisons)."""
