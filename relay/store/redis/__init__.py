"""The Redis store: the store, its clients (standalone, Sentinel, Cluster), replica waits
and start-up checks, and Redis URL parsing. The only package that imports redis.
"""
