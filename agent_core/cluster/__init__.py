"""Where a run's work runs (placement.py: this process or Ray) and scale-out on Ray (docs/scale-out.md):
inference replicas behind a router, weight sync, data-parallel training workers. Ray itself is
imported only when a config sets `cluster.address`."""
