"""The role each pool's ranks get from the topology: a prefill and a decode pool, or one colocated
pool that does both, each with its batch limits, its KV transfer and speculation settings and
the shared store's client settings and secret."""

from __future__ import annotations

from tandem.cluster.topology import PoolSpec, Topology
from tandem.decode.role import DecodeRole
from tandem.engine.colocated_role import ColocatedRole
from tandem.engine.engine_config import EngineConfig
from tandem.engine.role_spec import RoleSpec
from tandem.kvtransfer.kv_store import StoreConfig
from tandem.prefill.role import PrefillRole


def pool_roles(
    topology: Topology, store: StoreConfig | None, secret: bytes
) -> list[tuple[str, PoolSpec, RoleSpec]]:
    """Each pool's name (its groups are named by it), spec and role, prefill before decode."""
    c = topology.colocated
    if c is not None:
        engine = EngineConfig(
            page_size=c.page_size,
            num_pages=c.num_pages,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            prefill_chunk_tokens=c.prefill_chunk_tokens,
        )
        role = ColocatedRole(
            engine=engine, host_cache_pages=c.host_cache_pages, store=store, store_secret=secret
        )
        return [("colocated", c, role)]
    p, d = topology.prefill, topology.decode
    prefill = PrefillRole(
        num_pages=p.num_pages,
        page_size=p.page_size,
        max_num_seqs=p.max_num_seqs,
        kv_timeout_s=topology.kv_timeout_s,
        max_num_batched_tokens=p.max_num_batched_tokens,
        layerwise=topology.kv_transfer == "layerwise",
        mtp=topology.speculative.tokens > 0 and topology.speculative.drafter == "mtp",
        max_jobs=p.max_jobs,
        prefill_chunk_tokens=p.prefill_chunk_tokens,
        host_cache_pages=p.host_cache_pages,
        store=store,
        store_secret=secret,
    )
    decode = DecodeRole(
        num_pages=d.num_pages,
        page_size=d.page_size,
        max_num_seqs=d.max_num_seqs,
        kv_timeout_s=topology.kv_timeout_s,
        speculative=topology.speculative.config(),
        store=store,
        store_secret=secret,
    )
    return [("prefill", p, prefill), ("decode", d, decode)]
