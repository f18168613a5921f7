"""The gdngen version (its own module, so any stage can read it without importing the API)."""

__version__ = "0.1.0"
