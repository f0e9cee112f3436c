"""Signals: the engine's state scraped from ``/metrics``, ``/server_info`` and ``/v1/loads``
(``engine``), GPU free memory from NVML, DCGM or a file (``gpu``), values that cannot be true
(``plausible``) and the pollers' threads (``worker``). May import ``sidecar.core`` only."""
