"""Development tools: a local Envoy and a tiny upstream for demos, e2e tests and benchmarks."""
