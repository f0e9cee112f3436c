"""HTTP: the plain-ASGI streaming proxy with the gate in front (``proxy``), the client to the engine
(``engine_client``), uvicorn with the sidecar's connection limits (``server``), every response shape
(``answers``), the ``Host`` allow-list (``hosts``), the ASGI types (``asgi``) and the access log
(``access_log``). May import ``core``, ``policy``, ``intake``, ``admission`` and ``signals``."""
