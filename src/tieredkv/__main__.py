"""``python -m tieredkv``: the same as the ``tieredkv`` command."""

import sys

from .cli import main

sys.exit(main())
