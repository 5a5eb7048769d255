"""The embedded SQLite store (the default): :mod:`.store`, its writer thread :mod:`.writer`, its
rate-limit counters :mod:`.limits`, and its entry in the registry :mod:`.kind`."""
