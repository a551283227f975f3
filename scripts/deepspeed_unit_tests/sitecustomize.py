"""With DS_CANZONA_INJECT=1: every engine this process builds gets ds_canzona (ds_canzona_inject.py says how)."""

import os

if os.environ.get("DS_CANZONA_INJECT") == "1":
    from ds_canzona_inject import install

    install()
