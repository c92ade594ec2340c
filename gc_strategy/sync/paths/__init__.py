"""How a bucket travels across ranks: the route of every exchange (flat, or through the nodes), the
collectives they share, and the profiler that times an exchange along a route."""
