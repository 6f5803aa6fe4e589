"""The deployment's store secret: what signs and keys the shared store's KV blocks
(``engine/kv_block_codec.py``). The controller resolves it once and hands it to every rank in its
role spec; it is never logged, never in status, never in the controller's record.

Where it comes from, first found: the topology's ``store.secret_file``, the environment's
``TANDEM_KV_STORE_SECRET``, else 32 random bytes of this deployment's own. Deployments that share
a store share its blocks only when they name the same secret.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from tandem.cluster.topology import StoreSpec

SECRET_ENV = "TANDEM_KV_STORE_SECRET"
MIN_SECRET_BYTES = 16


class StoreSecretError(ValueError):
    """The named secret cannot be used; the message names where it came from."""


def store_secret(spec: StoreSpec | None) -> bytes:
    """The secret for a deployment with ``spec`` as its ``store:`` (``b""`` without a store)."""
    if spec is None:
        return b""
    if spec.secret_file is not None:
        try:
            secret, source = Path(spec.secret_file).read_bytes().strip(), "store.secret_file"
        except OSError as error:
            raise StoreSecretError(f"store.secret_file: cannot read {spec.secret_file}: {error}") from None
    elif os.environ.get(SECRET_ENV):
        secret, source = os.environ[SECRET_ENV].encode(), SECRET_ENV
    else:
        return secrets.token_bytes(32)
    if len(secret) < MIN_SECRET_BYTES:
        raise StoreSecretError(
            f"{source}: the secret has {len(secret)} bytes; give at least {MIN_SECRET_BYTES}"
        )
    return secret
