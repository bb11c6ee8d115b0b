"""The package's version, in a leaf module: any layer may read it without importing the
package root (``tieredkv/__init__.py`` re-exports it)."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
