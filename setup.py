"""ds_canzona: load-balanced matrix optimizers (Muon, Shampoo, SOAP) for DeepSpeed ZeRO."""

import os
import sys

from setuptools import find_packages, setup

# Build tools load plugins while this file runs (HuggingFace's `kernels` package registers an
# egg_info writer); with the checkout on sys.path, `import kernels` would find this repository's
# kernels/ instead of theirs and the install would fail. Nothing here imports from the checkout.
_CHECKOUT = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _CHECKOUT]

setup(
    name="ds_canzona",
    version="0.1.0",
    description="Canzona-style atomic, load-balanced matrix optimizers as a DeepSpeed ZeRO backend",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # kernels/ is installed as ds_canzona.kernels: a top-level `kernels` module would shadow
    # HuggingFace's `kernels` package, which transformers imports when it is present.
    # Every package under ds_canzona/ (a hand-kept list once left ds_canzona.zero.checkpoint out).
    packages=find_packages(include=["ds_canzona", "ds_canzona.*"]) + ["ds_canzona.kernels"],
    package_dir={"ds_canzona.kernels": "kernels"},
    package_data={"ds_canzona": ["data/*.json", "data/*/*.json", "data/*.txt", "data/corpus/*.txt"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19.0,<=0.19.8",  # the releases scripts/compat.sh passed on; see ds_canzona/zero/hook.py
        "triton>=3.0; platform_system=='Linux'",
        "hjson",
        "safetensors",
    ],
    extras_require={
        "test": ["pytest", "transformers", "accelerate"],
        "hf": ["transformers", "accelerate"],
        "plots": ["matplotlib"],
    },
    entry_points={"console_scripts": ["ds-canzona=ds_canzona.cli:main"]},
)
