"""Generated gRPC code for the pdserve.v1 API (make proto)."""
