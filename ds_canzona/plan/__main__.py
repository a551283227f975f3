"""``python -m ds_canzona.plan ...``: the same as ``ds-canzona plan ...``."""

import sys

from .report import main

sys.exit(main())
