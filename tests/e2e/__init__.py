"""End-to-end tests against a real Envoy."""
