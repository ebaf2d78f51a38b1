"""Generated gRPC stubs for voiced.v1 (see proto/generate.py). Do not edit by hand."""
