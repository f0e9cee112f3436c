"""What operators and routers read: the admin endpoints (``admin``), metrics and the decision log
(``telemetry``), the log pipeline (``logs``), and the lane's signals for routers (``router_view``,
``loads``). May import every layer below the composition root (``sidecar.app``, ``sidecar.cli``)."""
