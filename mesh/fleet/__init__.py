"""Other A2A agents as peers (:mod:`.peers`: the client, the address guard and the
delegation hops on the wire). Pools past one machine are Ray actors (:mod:`mesh.cluster`),
not processes this package routes to."""
