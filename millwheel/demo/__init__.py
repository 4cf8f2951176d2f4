"""Bundled demos."""
