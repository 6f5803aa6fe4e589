"""KV transports by name: the built-in ``nixl`` one (imported only when asked for: it loads NIXL)
and any other a module registers with ``register_transport``."""

from __future__ import annotations

from tandem.kvtransfer.transport import KVTransport

_REGISTRY: dict[str, type[KVTransport]] = {}


def register_transport(cls: type[KVTransport]) -> type[KVTransport]:
    _REGISTRY[cls.name] = cls
    return cls


def transport_class(name: str) -> type[KVTransport]:
    if name == "nixl" and name not in _REGISTRY:
        from tandem.kvtransfer.nixl_transport import NixlTransport  # loads NIXL: only when asked for

        _REGISTRY[NixlTransport.name] = NixlTransport
    if name not in _REGISTRY:
        raise ValueError(f"KV transport {name!r} is not known; known: {sorted(_REGISTRY) or ['nixl']}")
    return _REGISTRY[name]
