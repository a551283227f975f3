"""The fake world lives in the package now (the collectives benchmark runs on it).

It is ``ds_canzona.bench.standins.fake_world``.
"""

from ds_canzona.bench.standins.fake_world import fake_world

__all__ = ["fake_world"]
