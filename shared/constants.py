"""Stream names, consumer groups and key prefixes: the one place the bus layout is spelled."""

PREFIX = "rs"

# Work queues read by consumer groups (any replica may take an entry).
TOKENIZE_STREAM = f"{PREFIX}:tokenize"
TOKENIZE_GROUP = "tokenizer"
SCHEDULE_STREAM = f"{PREFIX}:schedule"
SCHEDULE_GROUP = "scheduler"
# Constrained requests pass through the grammar service between tokenizer and scheduler.
GRAMMAR_STREAM = f"{PREFIX}:grammar"
GRAMMAR_GROUP = "grammar"

# Compiled grammars shared by every grammar service and executor: f"{GRAMMAR_CACHE_PREFIX}:{key}"
# holds a GrammarCacheEntry (shared/messages/grammar.py); the key hashes kind, source, tokenizer.
GRAMMAR_CACHE_PREFIX = f"{PREFIX}:gcache"

# Liveness keys: f"{LIVE_PREFIX}:{service}:{instance}" holds a Heartbeat with a TTL.
LIVE_PREFIX = f"{PREFIX}:live"
# Generous against the refresh interval: a process starved of CPU for a few seconds (a long
# prefill on a busy host) must not be declared dead and have its requests failed.
LIVE_TTL_S = 10.0
HEARTBEAT_INTERVAL_S = 0.5

# Requests in flight, readable by every gateway (POST /abort_request): f"{RID_PREFIX}:{rid}"
# holds the rids of the HTTP call that dispatched it, until the call ends or its timeout.
RID_PREFIX = f"{PREFIX}:rid"

# The scheduler leader's instance id, a key with a TTL its leader refreshes.
SCHEDULER_LEADER_KEY = f"{PREFIX}:leader:scheduler"
# Hash rid -> where the scheduler routed it and the request itself, until it is done: what a
# new leader rebuilds its routing table from, and what a lost executor's requests resume from.
ROUTES_KEY = f"{PREFIX}:routes"

# Streams trimmed with MAXLEN ~ so Redis memory stays bounded. A per-instance stream's readers
# trim what they have consumed (StreamReader trim_consumed, or the detokenizer's low-water
# mark), so INSTANCE_STREAM_MAXLEN is only the cap for a reader that is gone: it must exceed
# what a live reader can lag by, since MAXLEN drops entries whether read or not (20,000 lost
# replies of a 2,000-request burst whose gateway fell a few seconds behind).
WORK_STREAM_MAXLEN = 100_000
INSTANCE_STREAM_MAXLEN = 200_000

# Idle time after which a pending entry of a work queue is claimed by another consumer.
CLAIM_IDLE_MS = 30_000


def executor_stream(executor_id: str) -> str:
    """Input stream of one executor (one reader)."""
    return f"{PREFIX}:exec:{executor_id}"


def detok_stream(partition: int) -> str:
    """Input stream of one detokenizer partition (one reader)."""
    return f"{PREFIX}:detok:{partition}"


def detok_lease_key(partition: int) -> str:
    """The owner of a detokenizer partition: its instance id, with a short TTL it extends."""
    return f"{detok_stream(partition)}:lease"


def reply_stream(gateway_id: str) -> str:
    """Reply stream of one gateway instance (one reader)."""
    return f"{PREFIX}:reply:{gateway_id}"


GRAMMAR_CACHE_TTL_S = 3600.0  # --grammar-cache-ttl's default


def grammar_cache_key(key: str) -> str:
    """Redis key of one compiled grammar (or of its compile error)."""
    return f"{GRAMMAR_CACHE_PREFIX}:{key}"


def rid_key(rid: str) -> str:
    return f"{RID_PREFIX}:{rid}"


def live_key(service: str, instance: str) -> str:
    return f"{LIVE_PREFIX}:{service}:{instance}"


def detok_partition(rid: str, partitions: int) -> int:
    """Stable partition of a request id; every message of one request goes to one detokenizer."""
    h = 0
    for ch in rid.encode():
        h = (h * 131 + ch) & 0xFFFFFFFF
    return h % partitions


# Model-load progress of a starting executor: f"{PROGRESS_PREFIX}:{service}:{instance}" holds a
# LoadProgress (shared/messages/progress.py) with a TTL, deleted once the model is loaded.
PROGRESS_PREFIX = f"{PREFIX}:progress"
PROGRESS_TTL_S = 60.0


def progress_key(service: str, instance: str) -> str:
    return f"{PROGRESS_PREFIX}:{service}:{instance}"
