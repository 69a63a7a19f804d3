"""Slow references and probes the tests compare against or plug into real runs."""
