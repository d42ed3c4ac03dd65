"""Launchers: start the router and worker pools as processes (Ray actors; Kubernetes via k8s/)."""
