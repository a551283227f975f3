"""ds_canzona: atomic, load-balanced matrix optimizers for DeepSpeed ZeRO."""

__version__ = "0.1.0"
