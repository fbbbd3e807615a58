"""Placeholder: built by its own issue."""
