"""Integrations of kvstrata's cache core into other serving systems (each the only importer of its host)."""
