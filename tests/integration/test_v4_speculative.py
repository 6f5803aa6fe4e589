"""DeepSeek-V4 with n-gram and MTP drafts through prefill/decode (the ``local`` preset: a DEP2
prefill group, a DEP2 decode group, real NIXL): a verify step whose drafts are rejected computes
the accepted tokens again from the state before the step, and in a DEP group every rank agrees
each step whether any of them does, so the group's MoE exchanges stay in step. With MTP, the
prefill ranks run the MTP layer over the prompt and its state crosses as the transfer's last
layer. The tokens are plain decoding's (the colocated engine's, themselves transformers'),
greedy and seeded, with K = 1 and 3; the bills carry the drafts the verify steps accepted, and
every page and state slot is free after."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import ray
import torch

from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, SpeculativeSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.tokenizer import Tokenizer
from tandem.model.train_demo_v4 import DEMO_V4_DIR
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import write_tiny_v4

PAGE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, ray_started: None) -> Path:
    directory = tmp_path_factory.mktemp("v4spec") / "model"
    write_tiny_v4(directory, seed=3, index_topk=3)
    return directory


@pytest.mark.parametrize("k", [1, 3])
def test_v4_ngram_drafts_through_prefill_and_decode_give_plain_decodings_tokens(
    model_dir: Path, k: int
) -> None:
    rng = random.Random(k)
    phrase = [rng.randrange(3, 256) for _ in range(6)]
    prompts = [phrase * 4 + [rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 23, 40)]
    _drafts_give_plain_decodings_tokens(model_dir, prompts, SpeculativeSpec(tokens=k, drafter="ngram"))


@pytest.mark.parametrize("k", [1, 3])
def test_v4_mtp_drafts_through_prefill_and_decode_give_plain_decodings_tokens(k: int) -> None:
    """The demo V4 model, whose MTP layer is trained: on its kind of text most drafts are taken."""
    tokenizer = Tokenizer.from_dir(DEMO_V4_DIR)
    texts = [
        "And God said",
        "In the beginning God created the heaven",
        "And the LORD spake unto Moses, saying",
    ]
    prompts = [tokenizer.encode(text) for text in texts]
    _drafts_give_plain_decodings_tokens(
        DEMO_V4_DIR, prompts, SpeculativeSpec(tokens=k, drafter="mtp"), most=True
    )


def _drafts_give_plain_decodings_tokens(
    model_dir: Path, prompts: list[list[int]], spec: SpeculativeSpec, most: bool = False
) -> None:
    sampling = [
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
        for i in range(len(prompts))
    ]
    engine = ColocatedEngine.from_model_dir(
        model_dir, torch.float64, EngineConfig(page_size=PAGE, num_pages=512)
    )
    want = [o.token_ids for o in engine.generate(prompts, sampling)]

    pool = PoolSpec(dep=2, page_size=PAGE, num_pages=120, max_num_seqs=8)
    topology = Topology.preset("local").model_copy(
        update={"prefill": pool, "decode": pool, "speculative": spec}
    )
    server = Server(ServeOptions(topology, model_dir, port=0, dtype="float64"))
    server.start()
    try:
        done = server.generate(prompts, sampling)
        assert [d.error for d in done] == [None] * len(prompts)
        assert [d.token_ids for d in done] == want
        drafted = sum(d.bill.speculation.draft_tokens for d in done)
        accepted = sum(d.bill.speculation.accepted_tokens for d in done)
        assert 0 < accepted < drafted, (accepted, drafted)  # some accepted, some rolled back
        if most:
            assert accepted > drafted / (2 * spec.tokens), (accepted, drafted)
        ray.get(server.controller.check_integrity.remote())
        for s in ray.get(server.controller.stats.remote()):
            assert s.free_pages == s.total_pages and (s.sends_in_flight, s.receives_in_flight) == (0, 0), s
    finally:
        server.stop()
