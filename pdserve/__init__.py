"""pdserve: CLI, launchers and the generated public API (pdserve.v1)."""
