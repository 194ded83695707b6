"""The encryption of API key secrets: Fernet tokens made with the master key
``HARVEST_SECRET_KEY``, which is checked when read and never echoed."""

from __future__ import annotations

import base64
import binascii
import re

from cryptography.fernet import Fernet, InvalidToken

from harvest.errors import ConfigurationError
from harvest.settings import Settings

NOT_SET = "HARVEST_SECRET_KEY is not set: refusing to store an API key secret unencrypted"

_FERNET_KEY = re.compile(r"^[A-Za-z0-9_-]{43}=$")


class Cipher:
    """Encrypts and decrypts API key secrets with the master key (Fernet: AES + HMAC).

    Made without a key, it refuses to encrypt or decrypt (:class:`ConfigurationError`).
    """

    def __init__(self, fernet: Fernet | None) -> None:
        self._fernet = fernet

    @classmethod
    def from_settings(cls, settings: Settings) -> Cipher:
        """The cipher of ``settings.secret_key`` (``HARVEST_SECRET_KEY``); an empty or unset key
        gives a cipher that refuses to store secrets.

        :raises ConfigurationError: the key is not a Fernet key (its value is never echoed).
        """
        raw = settings.secret_key.get_secret_value().strip() if settings.secret_key else ""
        return cls(Fernet(_check_master_key(raw)) if raw else None)

    @property
    def has_key(self) -> bool:
        """True when a master key is configured."""
        return self._fernet is not None

    def encrypt(self, secret: str) -> bytes:
        """The Fernet token of ``secret``.

        :raises ConfigurationError: no master key is configured.
        """
        if self._fernet is None:
            raise ConfigurationError(NOT_SET)
        return self._fernet.encrypt(secret.encode("utf-8"))

    def decrypt(self, token: bytes, *, key_id: int | None = None) -> str:
        """The secret in clear.

        :raises ConfigurationError: no master key, or not the one the secret was stored with.
        """
        if self._fernet is None:
            raise ConfigurationError("HARVEST_SECRET_KEY is not set: cannot decrypt an API key")
        try:
            return self._fernet.decrypt(bytes(token)).decode("utf-8")
        except InvalidToken:
            which = f"API key {key_id}" if key_id is not None else "an API key"
            raise ConfigurationError(
                f"HARVEST_SECRET_KEY cannot decrypt the secret of {which}: "
                "it was stored under another master key"
            ) from None

    def __repr__(self) -> str:
        return f"Cipher(key={'set' if self.has_key else 'not set'})"


def _check_master_key(raw: str) -> bytes:
    """``raw`` as Fernet key bytes: 32 bytes in url-safe base64 (44 characters)."""
    if _FERNET_KEY.match(raw):
        try:
            if len(base64.urlsafe_b64decode(raw)) == 32:
                return raw.encode("ascii")
        except (binascii.Error, ValueError):
            pass
    raise ConfigurationError(
        "HARVEST_SECRET_KEY is not a valid Fernet key: expected 32 bytes in url-safe base64 "
        "(44 characters), as made by cryptography's `Fernet.generate_key()`"
    )
