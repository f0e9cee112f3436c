"""The emulator: a model of an SGLang lane (``engine``, ``profiles``, ``device``, ``exposition``,
``server``), scenarios replayed through the real decision in virtual time (``scenario``, ``replay``,
``baselines``, ``plot``), fleets behind a router (``fleet``, ``fleet_replay``) and the demo. It is a
sibling of the runtime package: ``sidecar`` imports it only lazily, from the CLI's non-serving
commands, and its plotting needs the ``emulator`` extra."""
