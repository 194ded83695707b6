"""Masking of secrets: URLs with passwords and API keys never leave a process in clear."""

from __future__ import annotations

import re

# The password runs to the LAST "@" of the authority (drivers read "a:p@ss@host" that way).
_URL_PASSWORD = re.compile(
    r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^/\s]*)@"
)


def redact_url(url: str) -> str:
    """``postgresql://user:secret@host/db`` -> ``postgresql://user:***@host/db``."""
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url)


def mask_secret(secret: str) -> str:
    """``sk-abcdef...wxyz`` -> ``sk-…wxyz``: enough to tell keys apart, never enough to use one.

    At most a quarter of a secret is ever shown: the last 4 characters of one of 16 or more
    (2 of one of 10 to 15, none of a shorter one), and a short ``xx-`` prefix only when long."""
    tail = 4 if len(secret) >= 16 else 2 if len(secret) >= 10 else 0
    head = secret.split("-", 1)[0] + "-" if "-" in secret[:4] and len(secret) >= 16 else ""
    return f"{head}…{secret[-tail:] if tail else ''}"


def redact_text(text: str) -> str:
    """Redact every URL password inside a free text (log lines, error messages)."""
    return redact_url(text)
