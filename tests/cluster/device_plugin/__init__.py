"""The test nodes' device plugin (plugin.py) and its API (api.proto, with the Python modules
generated from it: api_pb2*, committed, left out of lint and type checks)."""
