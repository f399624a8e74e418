"""The endpoint's data plane: the HTTP server clients talk to, which forwards each request to a replica
(`python -m hpcserve.endpoint.dataplane`). It knows the controller only through endpoint.protocol."""
