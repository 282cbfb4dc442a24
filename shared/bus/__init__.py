"""The bus: connecting to NATS, the shared consume loop, dead letters and advisories."""
