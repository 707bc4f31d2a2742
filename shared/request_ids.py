"""Request ids: the one a client sees, and the one its request travels under.

A client may choose its request's rid (/generate's `rid`, SMG's `request_id`) and send the
same rid again once the request has ended, as a retry does. The services still remember the
rid for a while after it ends: a detokenizer drops late tokens of a finished request (an
executor may emit a few before a stop string's abort lands) and ignores a registration it has
already finished, so a second request under the same id would wait forever, or receive the
first one's last tokens. Each dispatch of a client's rid therefore travels under an id of its
own; the gateway (and the in-process Engine) answer and abort by the client's rid.
"""

from __future__ import annotations

import secrets
import uuid


def request_ids(chosen: str | None) -> tuple[str, str]:
    """(the rid the client knows, the id this dispatch travels under) of a request whose
    client chose the rid `chosen` (None: the client chose none, and a fresh rid is unique
    already, so it travels as it is)."""
    if chosen is None:
        rid = uuid.uuid4().hex
        return rid, rid
    return chosen, f"{chosen}.{secrets.token_hex(4)}"
