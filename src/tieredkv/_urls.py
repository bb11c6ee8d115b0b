"""Server URLs as messages and reports show them."""

from __future__ import annotations

import re

__all__ = ["redacted"]


def redacted(url: str) -> str:
    """``url`` without its password."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)
