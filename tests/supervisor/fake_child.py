"""A stand-in service for the supervisor tests: records each start, takes a liveness key
like a real service, then (FAKE_MODE=die) exits 3 once the test's go-file exists, or
(FAKE_MODE=run) runs until SIGTERM."""

from __future__ import annotations

import os
import sys
import time

import redis

from shared import constants

instance = os.environ["RADIXSERVE_INSTANCE_ID"]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(f"{instance} {time.monotonic()}\n")
r = redis.Redis.from_url(os.environ["REDIS_URL"])
r.set(constants.live_key("fake", instance), b"x", px=60_000)
if os.environ["FAKE_MODE"] == "run":
    while True:
        time.sleep(1)  # a service at work; SIGTERM ends it
go = os.environ["FAKE_GO"]
while not os.path.exists(go):
    time.sleep(0.01)
sys.exit(3)
