"""Deterministic workflow code only: no I/O, importable inside Temporal's sandbox."""
