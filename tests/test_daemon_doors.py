"""The Daemon opens the doors the config names, through the registry in voiced.doors, and drains
them all: stop accepting, wait for live calls, close."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from tests.daemon_harness import daemon_config
from voiced import doors
from voiced.config import ConfigError, load_config
from voiced.daemon import Daemon, door_addresses


def test_a_configured_door_is_opened_listed_and_drained_with_the_others(tmp_path, monkeypatch):
    # A door as another module would write it, found through the registry like any other.
    (tmp_path / "probe_door.py").write_text(textwrap.dedent('''
        log = []

        class ProbeDoor:
            name = "probe"

            def __init__(self, services, address):
                self.services, self.address = services, address

            async def start(self):
                log.append(("start", self.address))
                return "probe://" + self.address

            async def set_serving(self, serving):
                log.append(("serving", serving))

            async def stop_accepting(self):
                log.append(("stop_accepting", self.services.draining))

            async def close(self):
                log.append(("close", self.services.active_sessions))
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(doors.DOORS, "audiosocket", "probe_door:ProbeDoor")
    config = daemon_config()
    config.doors.audiosocket = "127.0.0.1:9999"

    async def scenario():
        daemon = Daemon(config)
        await daemon.start()
        opened = dict(daemon.services.doors)
        async with daemon.services.admit("probe"):  # a live call on the probe door
            drain = asyncio.create_task(daemon.drain_and_stop(grace=30))
            while not daemon.services.draining:
                await asyncio.sleep(0)
            await asyncio.sleep(0.2)
            assert not drain.done()  # waits for the live call
        await drain
        return opened, daemon.services.doors

    opened, after = asyncio.run(scenario())
    log = sys.modules["probe_door"].log
    assert opened["probe"] == "probe://127.0.0.1:9999" and opened["grpc"].startswith("127.0.0.1:")
    assert log == [("start", "127.0.0.1:9999"), ("serving", True), ("serving", False), ("stop_accepting", True),
                   ("close", 0)]
    assert after == {}
    sys.modules.pop("probe_door", None)


def test_a_door_that_cannot_be_built_says_what_to_do(monkeypatch):
    with pytest.raises(doors.DoorError, match="no front door named 'telegraph'"):
        doors.door_class("telegraph")
    monkeypatch.setitem(doors.DOORS, "wyoming", "voiced_probe_missing_module:Door")
    with pytest.raises(ModuleNotFoundError):
        doors.door_class("wyoming")  # our own module missing is a bug, not a missing package
    monkeypatch.setitem(doors.DOORS, "wyoming", "voiced.doors.grpc_server:GrpcDoor")
    assert doors.door_class("wyoming").__name__ == "GrpcDoor"


def test_a_missing_optional_package_names_it(tmp_path, monkeypatch):
    (tmp_path / "needs_pkg_door.py").write_text("import surely_not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(doors.DOORS, "media_ws", "needs_pkg_door:Door")
    with pytest.raises(doors.DoorError, match="needs the Python package 'surely_not_installed_pkg'.*doors.media_ws"):
        doors.door_class("media_ws")


def test_doors_config_keys_and_flags(tmp_path):
    from voiced.cli import serve

    cfg = tmp_path / "v.toml"
    cfg.write_text('[doors]\nwyoming = "tcp://127.0.0.1:10300"\n')
    config = load_config(cfg, env={"VOICED_DOORS_AUDIOSOCKET": "127.0.0.1:9092"})
    assert (config.doors.wyoming, config.doors.audiosocket, config.doors.media_ws) == \
        ("tcp://127.0.0.1:10300", "127.0.0.1:9092", "")
    assert [name for name, _ in door_addresses(config)] == ["grpc", "audiosocket", "wyoming"]
    with pytest.raises(ConfigError, match="unknown key doors.sip"):
        load_config(env={"VOICED_DOORS_SIP": "x"})
    import argparse

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--media-ws", "127.0.0.1:8080", "--http", "127.0.0.1:8000"])
    o = serve.overrides(args)
    assert o["doors.media_ws"] == "127.0.0.1:8080" and o["doors.http"] == "127.0.0.1:8000" and o["doors.wyoming"] is None
