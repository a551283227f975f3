"""The prepared GPU session's checks (``python -m ds_canzona.bench gpu-check PHASE``, run by scripts/gpu_session.sh).

``check`` is the command and its phases; ``validate`` runs every kernel through its public function
against float64; ``engine`` steps DeepSpeed engines (ZeRO-1/2/3 x Muon, Shampoo, SOAP) on one device
and times Newton-Schulz; ``syncs`` counts the device-to-host synchronisations of a region, with the
host-sync counter of ``ds_canzona.bench.standins`` and CUDA's own sync debug mode. Each also runs on
the CPU as a dry run (tests/test_gpu_session.py).
"""
