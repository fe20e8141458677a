"""OpenAI-compatible HTTP server and Prometheus metrics."""
