"""``python -m ds_canzona.plan ...``: the same as ``ds-canzona plan ...``.

An entry point, like the console script: it goes through the CLI, which calls the planner.
"""

import sys

from ds_canzona.cli import main

sys.exit(main(["plan", *sys.argv[1:]]))
