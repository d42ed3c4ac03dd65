"""Serving runtime shared by the router and both worker pools (below the CLI and launchers)."""
