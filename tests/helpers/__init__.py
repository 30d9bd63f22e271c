"""Helpers shared by several test modules (no tests here; shared pytest fixtures live in
tests/conftest.py). A test module imports from here, never from another test module."""
