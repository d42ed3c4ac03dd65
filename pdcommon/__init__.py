"""What every cluster component shares, below the router and the worker pools and above the
engine and transfer layers: the generated API (`pdcommon.v1`), the YAML config schema, the
worker runtime (engine thread, registration, heartbeats), proto conversions, logs and a client."""
