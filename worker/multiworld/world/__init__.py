"""One world at one epoch: its communicator, its ops and their `Work`, the backends, the
rendezvous and store it forms in, and the watch while it builds. Only these modules import torch
when they load (`core`, `ops`, `backends`, `stores`, `rendezvous`); importing the package loads
nothing.
"""
