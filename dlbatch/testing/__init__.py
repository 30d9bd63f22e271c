"""Helpers for tests and fault drills (importable without Ray or a model)."""
