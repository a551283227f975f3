"""pytest plugin for both runs of scripts/deepspeed_unit_tests.sh (stock and injected alike).

DeepSpeed's DistributedTest classes with ``reuse_dist_env = True`` keep one pool of rank
processes for all their cases. On CPU ranks here a case run in a reused pool hung until
DeepSpeed's timeout (the ZeRO-3 fragment case after a ZeRO-2 one, stock DeepSpeed; alone it
passes in 20 s), so each case gets fresh ranks unless DS_UNIT_REUSE_DIST_ENV=1.
"""

import os


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("DS_UNIT_REUSE_DIST_ENV") == "1":
        return
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and getattr(cls, "reuse_dist_env", False):
            cls.reuse_dist_env = False
