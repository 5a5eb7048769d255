"""The SMTP listener: the aiosmtpd handler and session, DATA reading, access, AUTH and TLS.

The only package that imports aiosmtpd.
"""
