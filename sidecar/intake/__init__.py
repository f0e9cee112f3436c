"""Intake: a request body parsed without copying it (``body``, ``idscan``), its prompt counted
(``tokens``), and priced as the core's ``Demand`` (``demand``). May import ``sidecar.core`` and
``sidecar.policy``."""
