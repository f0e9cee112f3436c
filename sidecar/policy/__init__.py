"""Lane policies: the YAML schema and its validation (``schema``, ``yamlfile``), the running policy's one
source (``source``: file, SIGHUP, uploads), what a policy will do (``summary``), the engine routes it
names (``engine_routes``), client priority bounds (``priority``), and the rules in force built from it
(``in_force``). May import ``sidecar.core`` only. The pydantic model stays in this package: the layers
above it read ``core.Rules``."""
