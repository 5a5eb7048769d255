"""Fingerprint stores, one package per kind (``redis/``, ``sqlite/``, ``postgres/``), each with
a ``kind`` module that :mod:`relay.store.registry` lists (:mod:`relay.store.kinds`); and the
settle journal (:mod:`relay.store.journal`)."""
