"""What the two roles that move KV between ranks share: a worker with a KV transport, whose
in-flight transfers keep the loop polling and whose peers it can reach ahead of a transfer."""

from __future__ import annotations

import logging

from tandem.engine.rank_loop import RankWorker
from tandem.kvtransfer.transport import KVTransport

log = logging.getLogger(__name__)


class TransferWorker(RankWorker):
    """A prefill or decode worker: ``transport`` moves its KV, ``name`` names its rank."""

    transport: KVTransport
    name: str

    def transfers_in_flight(self) -> bool:
        sends, receives = self.transport.in_flight()
        return bool(sends or receives)

    def connect_peers(self, ranks: list[str]) -> None:
        missed = self.transport.connect(ranks)
        if missed:
            log.info("rank %s: %d peers not reachable yet (%s); their first transfer connects",
                     self.name, len(missed), ", ".join(missed[:4]))  # fmt: skip
