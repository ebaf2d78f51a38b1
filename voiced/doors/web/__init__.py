"""The page a newcomer opens: `GET /` on the HTTP door. Plain HTML and JavaScript shipped in the
package (no build step, no CDN: it works offline) that talks to `/v1/realtime`. The microphone is
captured by an AudioWorklet at 24 kHz (Realtime's audio/pcm), and replies play through another
AudioWorklet that drops what it holds the moment the caller talks over it."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

HERE = Path(__file__).parent
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/capture-worklet.js": ("capture-worklet.js", "text/javascript; charset=utf-8"),
    "/player-worklet.js": ("player-worklet.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}


def routes() -> list[web.RouteDef]:
    def serve(name: str, content_type: str):
        body = (HERE / name).read_bytes()

        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=body, headers={"Content-Type": content_type, "Cache-Control": "no-cache"})

        return handler

    return [web.get(path, serve(name, ctype)) for path, (name, ctype) in FILES.items()]
