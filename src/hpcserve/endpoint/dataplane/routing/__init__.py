"""Which replica takes a request: the routing state and its indexes of what each replica's cache holds."""
