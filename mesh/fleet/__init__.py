"""Other A2A agents as peers (:mod:`.peers`, their addresses confined by :mod:`.peer_guard`)
and other ``mesh serve`` processes as pool nodes (:mod:`.nodes`, :mod:`.node_worker`)."""
