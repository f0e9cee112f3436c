"""``calibrate``: qualify a lane by probing it and fit the cost terms of a policy (``fit``, pure but for
two protocols), over the engine's HTTP API and a GPU source (``command``). May import ``core``,
``policy`` and ``signals``."""
