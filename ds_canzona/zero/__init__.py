"""DeepSpeed runtime: the engine hook, bucketed buffers, the ZeRO-1/2 optimizer, checkpoints."""
