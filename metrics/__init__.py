"""Prometheus metrics of every Tandem process, the HTTP endpoint that serves them, and the
service-discovery document that lists every scrape target of a deployment."""
