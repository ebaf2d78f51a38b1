"""Clients for the voiced daemon: stream a file, push-to-talk from the microphone, generate load.

Installable on its own (``pip install ./client``): it needs grpcio, protobuf, numpy and soxr, never
torch or the daemon. The gRPC stubs live in ``voiced_client.proto``.
"""

__version__ = "0.1.0"
