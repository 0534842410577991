"""Triton kernels and the fusion code generator (filled in by the fusion issue)."""
