"""The one framing of every byte stream between processes (submits to a decode rank and their
answers, stream batches back to a frontend)::

    | length: 8 bytes, big-endian | payload: ``length`` bytes, one pickled message of ``wire`` |

One limit for every reader: a frame longer than ``MAX_FRAME_BYTES`` is refused (``FrameTooLarge``)
and its connection closed. Pickle is safe here only because every connection is authenticated
first (a secret the receiver handed out through Ray) and runs between the deployment's own
processes."""

from __future__ import annotations

import pickle
from typing import IO, Any

LENGTH_BYTES = 8
# a step's stream batch for every request of a frontend, or a submit of long prompts, with room
MAX_FRAME_BYTES = 256 << 20


class FrameTooLarge(ConnectionError):
    def __init__(self, length: int) -> None:
        super().__init__(f"a frame of {length} bytes; at most {MAX_FRAME_BYTES} are read")
        self.length = length


def frame(payload: Any) -> bytes:
    """``payload`` as one frame."""
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(LENGTH_BYTES, "big") + data


def frame_length(head: bytes) -> int:
    """The payload length a frame's ``LENGTH_BYTES`` head announces; ``FrameTooLarge`` past the
    limit."""
    length = int.from_bytes(head, "big")
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(length)
    return length


def unframe(payload: bytes) -> Any:
    """The message of a frame's payload."""
    return pickle.loads(payload)


def read_frame(stream: IO[bytes]) -> Any | None:
    """The next message on a blocking ``stream``, or ``None`` at its end."""
    head = stream.read(LENGTH_BYTES)
    if len(head) < LENGTH_BYTES:
        return None
    length = frame_length(head)
    body = stream.read(length)
    return unframe(body) if len(body) == length else None
