"""Upstream adapters: the SMTP smarthost client (connection pool, transfer, negotiation)
and the Maildir sink. The only package that imports aiosmtplib.
"""
