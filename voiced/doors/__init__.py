"""The front doors: one module per protocol, each a thin adapter over voiced.core.

`DOORS` names every door and where its class lives ("module:Class"). Modules are imported only
when their door is configured, so a door's optional package (aiohttp, wyoming, ...) matters only
to those who open it. A door class is built as `cls(services, address)` and has:

    name: str                        its `front` label in metrics and logs
    async start() -> str             bind and serve; returns the bound address
    async stop_accepting()           drain begins: refuse new calls (live ones go on)
    async close()                    end everything it still holds
    async set_serving(bool)          optional: the daemon's health changed (loaded / draining)
"""

from __future__ import annotations

import importlib

from voiced.doors.shared import DoorError

# name -> "module:Class". `grpc` is always open (server.listen); the others open when their
# `[doors]` config key is set.
DOORS: dict[str, str] = {
    "grpc": "voiced.doors.grpc_server:GrpcDoor",
    "audiosocket": "voiced.doors.audiosocket:AudioSocketDoor",
    "media_ws": "voiced.doors.media_ws:MediaStreamDoor",
    "http": "voiced.doors.http:HttpDoor",
    "wyoming": "voiced.doors.wyoming:WyomingDoor",
}


def door_class(name: str) -> type:
    target = DOORS.get(name)
    if target is None:
        raise DoorError(f"no front door named {name!r} in this build of voiced; doors: {', '.join(sorted(DOORS))}")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("voiced"):
            raise DoorError(f"the {name} door needs the Python package {e.name!r}, which is not installed "
                            f"(pip install {e.name}), or leave doors.{name} empty") from None
        raise
    return getattr(module, class_name)


def build(name: str, services, address: str):
    return door_class(name)(services, address)
