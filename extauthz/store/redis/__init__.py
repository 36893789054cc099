"""The Redis store, as a small package:

* :mod:`.url`      Redis URLs -> a redis-py client (single, Cluster, Sentinel)
* :mod:`.wire`     the Lua scripts by SHA, EVALSHA packing, reply decoding, error wrapping,
  and the one NOSCRIPT path (load, resend)
* :mod:`.batcher`  the auto-batcher (calls of one event-loop iteration in one round trip;
  releases ride with the next check)
* :mod:`.conn`     the lean client path (one connection per node, hiredis, FIFO of futures)
* :mod:`.cluster`  Redis Cluster: groups by hash tag, per-master pipelines, compensation
* :mod:`.store`    :class:`RedisStore`, the store contract
"""

from .store import RedisStore
from .wire import SCRIPT_NAMES, Script, StoreStats, load_script

__all__ = ["SCRIPT_NAMES", "RedisStore", "Script", "StoreStats", "load_script"]
