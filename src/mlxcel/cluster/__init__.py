"""Scale-out on Ray Serve (spec X): `mlxcel cluster --replicas N [serve flags]`.

Each replica is one `serve` process's worth of work (the same startup path, app factory and
protocol adapters) inside a Ray Serve deployment; one HTTP entry point forwards every route
to a replica chosen by a prefix-cache-aware request router. Ray is an optional extra
(`mlxcel[cluster]`): only `command`, `router` and `replica` import it.
"""
