"""Telemetry: Prometheus metrics, OpenTelemetry tracing and JSON logs for every service."""
