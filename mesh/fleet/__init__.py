"""Other A2A agents as peers (:mod:`.peers`, their addresses confined by :mod:`.peer_guard`;
the delegation hops on the wire: :mod:`.hops`). Pools past one machine are Ray actors
(:mod:`mesh.cluster`), not processes this package routes to."""
