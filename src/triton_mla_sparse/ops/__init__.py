"""Operators: one subpackage per op (kernels, heuristics, launch, interface)."""
