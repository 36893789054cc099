"""The gRPC edge: Envoy's Authorization and AccessLogService APIs, health, admin."""
