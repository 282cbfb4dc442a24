"""Sink: delivers results and job events into each tenant's streams."""
