"""The PostgreSQL fingerprint store (asyncpg): :mod:`.store`, its schema in :mod:`.migrations`."""
