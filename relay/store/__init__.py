"""Fingerprint stores: embedded SQLite, Redis (``redis/``), and the settle journal."""
