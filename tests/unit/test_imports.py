"""Import hygiene: a server on the embedded store never loads the Redis client
(``extauthz/__init__.py`` promises it is imported only when a Redis store is)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from ..conftest import ROOT

#: builds and starts a server on the embedded store (every port the serve path opens by
#: default, metrics and HTTP too), stops it and prints the Redis modules loaded meanwhile.
_SERVE_EMBEDDED = textwrap.dedent("""
    import asyncio, sys
    import extauthz.commands.cli, extauthz.commands.opscli, extauthz.observe.metrics
    from extauthz.server.app import Server, ServerConfig

    async def main():
        config = ServerConfig(policies=[sys.argv[1]], listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                              admin_listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        server = Server(config)
        await server.start()
        assert server.port and server.http_port, "a port is not up"
        await server.stop(0.0)

    asyncio.run(main())
    print(sorted(m for m in sys.modules if m == "redis" or m.startswith(("redis.", "extauthz.store.redis"))))
""")


def test_a_server_on_the_embedded_store_does_not_import_redis() -> None:
    out = subprocess.run([sys.executable, "-c", _SERVE_EMBEDDED, str(ROOT / "policies")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


_COMMAND_LINE = textwrap.dedent("""
    import sys
    from extauthz.commands.cli import build_parser, main

    def loaded(heavy):
        return sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))

    server = ("pydantic", "aiohttp", "grpc", "prometheus_client", "redis", "extauthz.policy",
              "extauthz.limiters", "extauthz.control.overrides", "extauthz.server.adminauth")
    build_parser()  # every command's options, as `extauthz COMMAND --help` builds them
    print(loaded((*server, "asyncio")))
    for argv in (["status"], ["switch", "--list"], ["history"]):  # an admin port nobody listens on
        assert main([*argv, "--admin", "http://127.0.0.1:9"]) == 1
    print(loaded(server))
""")


def test_the_command_line_starts_without_the_policy_models_or_the_servers_libraries() -> None:
    """`extauthz status --help` took 1-3 s: the CLI imported the policy's pydantic models and
    the server's libraries before parsing a flag. Each command now imports what it runs:
    status, switch and history reach an admin port with neither."""
    out = subprocess.run([sys.executable, "-c", _COMMAND_LINE], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "[]"], out.stdout
