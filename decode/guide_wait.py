"""Guided requests on a decode rank whose grammar may still compile (``DecodeRequest.guide_pending``).

A step never waits for a compile, nor does its DEP group: a running request whose grammar is not
ready sits the step out, keeping its KV, and joins once it is. One whose grammar did not compile,
or not within the rank's limit, ends with the error once its KV is here, its pages freed.
Torch-free: the grammar's readiness is asked of ``ready`` (the runner's ``guide_ready``).
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import DecodeFinished
from tandem.engine.request import RequestStatus
from tandem.wire.request_params import InvalidRequestError, SamplingParams

# (request id, its sampling, when it arrived) -> its grammar is compiled; raises
# ``InvalidRequestError`` when it failed or passed the limit
GuideReady = Callable[[str, SamplingParams, float], bool]


def grammars_held(
    scheduler: DecodeScheduler, ready: GuideReady
) -> tuple[frozenset[str], list[DecodeFinished]]:
    """The running requests that sit the next step out, and those that end now with their
    grammar's error (the caller finishes them)."""
    held: set[str] = set()
    failed: list[DecodeFinished] = []
    for record in scheduler.records():
        if not record.guide_pending:
            continue
        request = record.request
        if record.guide_error is None:
            try:
                if ready(record.request_id, request.sampling, record.received_at):
                    record.guide_pending = False
                    continue
            except InvalidRequestError as error:
                record.guide_error = str(error)
        if request.status is not RequestStatus.RUNNING:
            continue
        if record.guide_error is None:
            held.add(record.request_id)
        elif (finished := scheduler.fail(record.request_id, record.guide_error)) is not None:
            failed.append(finished)
    return frozenset(held), failed
