"""Test and benchmark support for conduit-srl: a record type, an SRL-shaped driver, endpoints."""
