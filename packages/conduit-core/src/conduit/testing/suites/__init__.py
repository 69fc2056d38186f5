"""The suites (assertion-rewritten by pytest for readable failures)."""
