"""Whose cached prefixes a request may share: the salt mixed into its prompt's block chain
(``engine/prefix_cache.py`` ``chain_root``).

Without it every client shares the device pages, the host tier and the store, and a bill's
``cached_tokens`` (or its TTFT) tells a client whether a prefix it guessed was sent by another.
So the chain a request's blocks are named by depends on::

    request's cache_salt given     "request:" + the salt     clients that send the same salt share
    none, authenticated client     the token file's default  private to the client, or the file's
                                   (``ClientToken.cache_salt``) shared salt ("shared:" + its name)
    none, no token file            None                      the unsalted chain: everyone shares

The three kinds are prefixed apart so that no salt a client sends names a token file's salt.
"""

from __future__ import annotations

from tandem.frontend.grpc_auth import ClientToken
from tandem.wire.request_params import InvalidRequestError

MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(value: object, field: str = "cache_salt") -> str:
    """A salt a client sent: a non-empty string of at most ``MAX_CACHE_SALT_CHARS``."""
    if not isinstance(value, str):
        raise InvalidRequestError(field, f"must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidRequestError(field, "must be a non-empty string (leave it out for the default)")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(field, f"{len(value)} characters; at most {MAX_CACHE_SALT_CHARS}")
    return value


def chain_salt(given: str | None, client: ClientToken | None) -> str | None:
    """The salt a request's chain is computed with: the one it was sent with, else its client's
    default (``client`` is None when the server has no token file)."""
    if given is not None:
        return "request:" + given
    return client.cache_salt if client is not None else None
