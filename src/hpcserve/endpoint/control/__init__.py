"""The endpoint's control plane: the controller that launches and watches members, puts their replicas
into the data plane (through its admin API, endpoint.protocol) and heals, scales and hands over; and the
commands' side of it (start, adopt, status, stop). It knows the data plane only through endpoint.protocol."""
