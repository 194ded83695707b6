"""redact_url / redact_text / mask_secret: a secret never leaves in clear."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harvest.redact import mask_secret, redact_text, redact_url

schemes = st.sampled_from(["postgresql", "postgresql+psycopg", "redis", "rediss", "amqp", "https"])
users = st.text(alphabet=string.ascii_letters + string.digits + "_.-", max_size=12)
# What may stand in a URL's password (RFC 3986 userinfo, percent-encoding included), minus "@".
passwords = st.text(
    alphabet=string.ascii_letters + string.digits + "-._~!$&'()*+,;=:%", min_size=1, max_size=40
)
hosts = st.sampled_from(["127.0.0.1", "db.internal", "localhost:5432", "[::1]:6379"])
rests = st.sampled_from(["", "/0", "/harvest", "/harvest?sslmode=require", "/vhost#frag"])


@given(schemes, users, passwords, hosts, rests)
def test_redact_url_hides_exactly_the_password(
    scheme: str, user: str, password: str, host: str, rest: str
) -> None:
    url = f"{scheme}://{user}:{password}@{host}{rest}"
    assert redact_url(url) == f"{scheme}://{user}:***@{host}{rest}"


@given(schemes, users, passwords, hosts, rests)
def test_redact_text_hides_passwords_inside_messages(
    scheme: str, user: str, password: str, host: str, rest: str
) -> None:
    url = f"{scheme}://{user}:{password}@{host}{rest}"
    message = f'connection to "{url}" failed; retrying {url} in 5s'
    redacted = f"{scheme}://{user}:***@{host}{rest}"
    assert redact_text(message) == f'connection to "{redacted}" failed; retrying {redacted} in 5s'


@pytest.mark.parametrize(
    "url",
    ["postgresql://postgres@127.0.0.1:5432/harvest", "redis://127.0.0.1:6379/0", "plain text"],
)
def test_urls_without_password_are_unchanged(url: str) -> None:
    assert redact_url(url) == url


def test_two_urls_each_lose_their_password() -> None:
    text = "db=postgresql://u:first-secret@db/h broker=amqp://guest:second-secret@mq//"
    redacted = redact_text(text)
    assert "first-secret" not in redacted
    assert "second-secret" not in redacted
    assert redacted == "db=postgresql://u:***@db/h broker=amqp://guest:***@mq//"


def test_password_containing_at_sign_is_hidden_whole() -> None:
    """redis-py (urllib.parse) reads ``redis://:p@ss@host`` with password ``p@ss``: the whole
    password, not its part before the first "@", must be hidden."""
    redacted = redact_url("redis://:hunter2@prod@cache.internal:6379/0")
    assert "prod" not in redacted
    assert redacted == "redis://:***@cache.internal:6379/0"


secret_alphabet = string.ascii_letters + string.digits + "-_"


secrets_ = st.text(alphabet=secret_alphabet, min_size=1, max_size=80) | st.builds(
    "{}-{}".format,  # vendor-style keys: "sk-…", "key-…"
    st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=5),
    st.text(alphabet=secret_alphabet, min_size=1, max_size=60),
)


@given(secrets_)
def test_mask_secret_shows_at_most_half_of_the_secret(secret: str) -> None:
    masked = mask_secret(secret)
    shown = masked.replace("…", "")
    assert "…" in masked
    assert secret not in masked
    assert len(shown) <= len(secret) // 2, (secret, masked)


@pytest.mark.parametrize("secret", ["abcde-xyz1", "sk-abcdef", "key-12345"])
def test_short_secret_with_a_dash_is_not_shown_whole(secret: str) -> None:
    shown = mask_secret(secret).replace("…", "")
    assert len(shown) <= len(secret) // 2, (secret, mask_secret(secret))


def test_mask_secret_keeps_keys_apart_by_their_ends() -> None:
    first = mask_secret("sk-" + "a" * 40 + "0001")
    second = mask_secret("sk-" + "a" * 40 + "0002")
    assert first == "sk-…0001"
    assert first != second


@pytest.mark.parametrize("secret", ["", "a", "abcd"])
def test_tiny_secrets_show_nothing(secret: str) -> None:
    assert mask_secret(secret) == "…"
