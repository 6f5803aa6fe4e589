"""The store's blocks are the deployment's own: a block forged from public information, written
under another deployment's secret, or holding other tokens than the request's is a counted miss,
and nothing stored tells a reader which tokens a block holds."""

from __future__ import annotations

import json
import zlib
from array import array

import pytest

from tandem.engine import kv_block_codec, prefix_cache
from tandem.engine.kv_block_codec import MAGIC, StoredBlock, encode_block
from tandem.engine.prefix_cache import block_hashes
from tandem.wire import block_chain
from tests.engine.test_kv_tiers import (
    LAYOUT,
    PAGE,
    SECRET,
    compute,
    fetched_match,
    payload_of,
    tiered_cache,
    write_through,
)
from tests.kv_store_double import DictStore

PROMPT = [123_456_789 + i for i in range(2 * PAGE + 1)]  # 2 full pages + 1: ids easy to spot


def _written(store: DictStore, secret: bytes = SECRET) -> list[int]:
    """A rank of the deployment with ``secret`` computes PROMPT; its blocks go to ``store``."""
    cache, tiers = tiered_cache(num_pages=8, store=store, secret=secret)
    compute(cache, PROMPT)
    write_through(tiers, store)
    return block_hashes(PROMPT, PAGE)


def _public_forgery(block: int, parent: int | None, tokens: list[int], payload: bytes) -> bytes:
    """A block as whoever reads the code can build one: this format's magic and header, any
    checksum the format had (CRC-32), every field from the public checkpoint and the prompt."""
    header = {
        "model": "m",
        "layout": LAYOUT.as_list(),
        "hash": block,
        "parent": parent,
        "tokens": tokens,
        "payload_bytes": len(payload),
        "crc32": zlib.crc32(payload),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + len(head).to_bytes(4, "big") + head + payload


def test_a_block_forged_without_the_secret_is_a_counted_miss() -> None:
    store = DictStore()
    blocks = _written(store)
    parents = [None, *blocks[:-1]]
    garbage = bytes(range(256)) * (len(payload_of(0)) // 256 + 1)
    for i, key in enumerate(sorted(store.values, key=list(store.values).index)):  # keys are public
        tokens = PROMPT[i * PAGE : (i + 1) * PAGE]
        store.values[key] = _public_forgery(blocks[i], parents[i], tokens, garbage[: len(payload_of(0))])
    cache, tiers = tiered_cache(num_pages=8, store=store)
    found = fetched_match(cache, PROMPT)
    assert found.store_tokens == 0 and tiers.store_rejected == 1
    cache.free(found.page_ids)

    # signed with a secret the forger guessed (the format, not the deployment's key)
    for i, key in enumerate(list(store.values)):
        tokens = PROMPT[i * PAGE : (i + 1) * PAGE]
        store.values[key] = encode_block(
            b"guess", StoredBlock(key, parents[i], tokens), "m", LAYOUT, payload_of(1)
        )
    other, other_tiers = tiered_cache(num_pages=8, store=store)
    found = fetched_match(other, PROMPT)
    assert found.store_tokens == 0 and other_tiers.store_rejected == 1
    assert other_tiers.stats().store_rejected == 1
    other.free(found.page_ids)
    other.check_integrity()


def test_a_block_of_another_deployments_secret_is_a_miss() -> None:
    store = DictStore()
    _written(store, secret=b"deployment one's secret")
    cache, tiers = tiered_cache(num_pages=8, store=store, secret=b"deployment two's secret")
    found = fetched_match(cache, PROMPT)
    assert found.store_tokens == 0  # its keys are not the other's: nothing to find
    cache.free(found.page_ids)
    # the same blocks under this deployment's keys: their tags do not check
    blocks = block_hashes(PROMPT, PAGE)
    for block, value in zip(blocks, list(store.values.values()), strict=True):
        store.values[tiers.key(block)] = value
    other, other_tiers = tiered_cache(num_pages=8, store=store, secret=b"deployment two's secret")
    found = fetched_match(other, PROMPT)
    assert found.store_tokens == 0 and other_tiers.store_rejected == 1
    # a deployment that names the same secret shares them
    same, _ = tiered_cache(num_pages=8, store=store, secret=b"deployment one's secret")
    assert fetched_match(same, PROMPT).store_tokens == 2 * PAGE


def test_no_token_id_and_no_block_hash_can_be_read_from_what_is_stored() -> None:
    store = DictStore()
    blocks = _written(store)
    assert len(store.values) == 2
    stored = b"".join(k.encode() + v for k, v in store.values.items())
    for block in blocks:  # the test's stand-in KV is spelled with its block: not what is looked for
        stored = stored.replace(payload_of(block), b"")
    for i in range(2):
        tokens = PROMPT[i * PAGE : (i + 1) * PAGE]
        for token in tokens:
            assert str(token).encode() not in stored
        for code in ("q", "l", "i"):
            assert array(code, tokens).tobytes() not in stored
    for block in blocks:
        for spelled in (f"{block:016x}", f"{block:x}", str(block)):
            assert spelled.encode() not in stored
        assert block.to_bytes(8, "little") not in stored and block.to_bytes(8, "big") not in stored


def test_a_block_whose_hash_matches_but_whose_tokens_differ_is_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 64-bit block hash can collide: with a weak hash standing in for one, a block another
    prompt wrote under the same hash must not be taken for this prompt's."""

    def weak_hash(parent: int | None, token_ids) -> int:
        return ((parent or 0) * 31 + sum(token_ids)) % (1 << 64)

    monkeypatch.setattr(block_chain, "block_hash", weak_hash)
    monkeypatch.setattr(prefix_cache, "block_hash", weak_hash)
    monkeypatch.setattr(kv_block_codec, "block_hash", weak_hash, raising=False)
    store = DictStore()
    writer, writer_tiers = tiered_cache(num_pages=8, store=store)
    swapped = [PROMPT[1], PROMPT[0], *PROMPT[2:]]  # same sums page by page: same hashes
    compute(writer, swapped)
    write_through(writer_tiers, store)
    assert block_hashes(swapped, PAGE) == block_hashes(PROMPT, PAGE)

    reader, tiers = tiered_cache(num_pages=8, store=store)
    found = fetched_match(reader, PROMPT)
    assert found.store_tokens == 0 and tiers.store_rejected == 1
    reader.free(found.page_ids)
    reader.check_integrity()
