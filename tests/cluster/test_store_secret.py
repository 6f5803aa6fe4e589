"""The deployment's store secret: named by the topology or the environment, else random; never
shown in a role spec's repr (what logs and errors print)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cluster.store_secret import SECRET_ENV, StoreSecretError, store_secret
from tandem.cluster.topology import StoreSpec
from tandem.engine.colocated_role import ColocatedRole
from tandem.prefill.role import PrefillRole


def test_a_deployment_names_its_secret_or_gets_a_random_one_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert store_secret(None) == b""
    one, two = store_secret(StoreSpec()), store_secret(StoreSpec())
    assert len(one) == 32 and one != two  # two deployments that name none share nothing
    path = tmp_path / "secret"
    path.write_bytes(b"a secret two deployments share\n")
    assert store_secret(StoreSpec(secret_file=str(path))) == b"a secret two deployments share"
    monkeypatch.setenv(SECRET_ENV, "from the environment, long enough")
    assert store_secret(StoreSpec()) == b"from the environment, long enough"
    path.write_bytes(b"short")
    with pytest.raises(StoreSecretError, match=r"store\.secret_file: the secret has 5 bytes"):
        store_secret(StoreSpec(secret_file=str(path)))
    with pytest.raises(StoreSecretError, match="cannot read"):
        store_secret(StoreSpec(secret_file=str(tmp_path / "missing")))


def test_a_role_spec_carries_the_secret_but_never_shows_it() -> None:
    secret = b"do-not-print-this-secret"
    role = PrefillRole(
        num_pages=8, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, store_secret=secret
    )
    assert role.store_secret == secret and "do-not-print" not in repr(role)
    assert "do-not-print" not in repr(ColocatedRole(store_secret=secret))


def test_the_cli_names_the_secret_file_of_the_store_it_turns_on(tmp_path: Path) -> None:
    from argparse import Namespace

    from tandem.cli.serving import with_tiers
    from tandem.cluster.topology import Topology
    from tandem.wire.request_params import InvalidRequestError

    local = Topology.preset("local")
    path = str(tmp_path / "secret")

    def args(**given: object) -> Namespace:
        flags = {"host_cache_pages": None, "device_cache_pages": None, "kv_store": None}
        return Namespace(**(flags | {"kv_store_secret_file": None} | given))

    topology = with_tiers(args(kv_store="auto", kv_store_secret_file=path), local)
    assert topology.store is not None and topology.store.secret_file == path
    with pytest.raises(InvalidRequestError, match="--kv-store-secret-file"):
        with_tiers(args(kv_store_secret_file=path), local)
