"""The cluster simulator (`pdserve simulate`): request traces and synthetic loads, a
discrete-event cluster driven by step-cost profiles, and the planner against the best static split."""

from pdserve.sim.traces import TraceRequest, bursty, diurnal, load_trace, poisson

__all__ = ["TraceRequest", "bursty", "diurnal", "load_trace", "poisson"]
