"""``python -m tieredkv.cli``: the same as the ``tieredkv`` command."""

import sys

from . import main

sys.exit(main())
