"""The cluster simulator (issue 11): request traces and synthetic loads so far."""

from pdserve.sim.traces import TraceRequest, bursty, diurnal, load_trace, poisson

__all__ = ["TraceRequest", "bursty", "diurnal", "load_trace", "poisson"]
