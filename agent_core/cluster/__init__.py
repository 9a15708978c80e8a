"""Scale-out on Ray (docs/scale-out.md): inference replicas behind a router, weight sync,
data-parallel training workers. Imported only when a config sets `cluster.address`."""
