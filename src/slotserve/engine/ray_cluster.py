"""This process's connection to Ray, shared by everything here that places work on it (worker ranks,
data-parallel replicas). Where no Ray is connected yet, `RAY_ADDRESS` names the cluster to join; without
it, Ray joins one started on this machine (`ray start`), else starts a local one. A Ray that this module
connected is shut down when its last user releases it; one the caller connected is left alone.
"""

from __future__ import annotations

import os
import threading

import ray

_lock = threading.Lock()
_users = 0  # live users of the Ray this module connected


def acquire() -> bool:
    """Connects (or joins the connection); True where the caller must `release` it."""
    global _users
    with _lock:
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"))
            _users = 1
            return True
        if _users:
            _users += 1
            return True
        return False


def release() -> None:
    """One user of this module's connection is done; the last one shuts Ray down."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0 and ray.is_initialized():
            ray.shutdown()
