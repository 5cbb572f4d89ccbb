"""The package's version, in the core so that every layer can stamp it without importing the top."""

from __future__ import annotations

__version__ = "0.1.0"
